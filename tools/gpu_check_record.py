"""Files a `tools/gpu_check.sh` result (`gpu_check.json`) as a benchmark record.

The GPU check runs on a lent machine with no access to this repository's history;
its `gpu_check.json` comes back through the device tool's output folder. This
wraps it in the record format of `benchmarks.records` (provenance:
date, device, JAX version, the command, the commit it ran) so that
`tools/bench_report.py` renders it into docs/benchmarks.md with the other
benchmarks.

Usage:
  PYTHONPATH=. python tools/gpu_check_record.py OUT/gpu_check.json --commit=b011580 --cpus=16 \
      --record=docs/records/gpu_check/
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

from benchmarks import records

_ROOT = pathlib.Path(__file__).resolve().parents[1]


def to_record(result: dict, *, commit: str, source: str, cpus: int | None = None) -> dict:
  """The record of one `gpu_check.json` (`result`) run at `commit` on a machine
  with `cpus` CPU cores (the check does not record them)."""
  missing = {"date", "command", "rows", "summary", "jax", "device_kind"} - set(result)
  if missing:
    raise ValueError(f"{source}: not a gpu_check result (missing {sorted(missing)})")
  return {
      "schema": records.SCHEMA, "bench": "gpu_check", "command": "python " + result["command"],
      "argv": result["command"].split(), "flags": {"budget_s": result.get("budget_s")},
      "seeds": None, "git": {"commit": commit, "dirty": False},
      "date": result["date"], "wall_s": result["summary"].get("wall_s"),
      "machine": {"gpu": result.get("nvidia_smi"), "python": result.get("python"),
                  "cpu_count": cpus, "machine": result.get("nvidia_smi"),
                  "load_avg_start": None, "load_avg_end": None},
      "jax": {"jax": result["jax"], "jaxlib": result.get("jaxlib"),
              "backend": result.get("backend"), "device_kind": result["device_kind"]},
      "notes": [f"filed from {source} by tools/gpu_check_record.py"],
      "results": result,
  }


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("result", help="a gpu_check.json")
  parser.add_argument("--commit", required=True, help="the commit the check ran at")
  parser.add_argument("--record", required=True, help="the records directory")
  parser.add_argument("--cpus", type=int, default=None, help="the machine's CPU cores")
  args = parser.parse_args(argv)
  src = pathlib.Path(args.result)
  try:
    args.commit = subprocess.run(["git", "rev-parse", "--verify", args.commit + "^{commit}"],
                                 cwd=_ROOT, capture_output=True, text=True,
                                 check=True).stdout.strip()
  except subprocess.CalledProcessError:
    print(f"error: {args.commit!r} is not a commit of this repository", file=sys.stderr)
    return 2
  try:
    result = json.loads(src.read_text())
    rec = to_record(result, commit=args.commit, source=src.name, cpus=args.cpus)
  except (OSError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  out = pathlib.Path(args.record)
  out.mkdir(parents=True, exist_ok=True)
  stamp = rec["date"].replace("-", "").replace(":", "")
  target = out / f"gpu_check-{stamp}-{src.stem}.json"
  target.write_text(json.dumps(rec, indent=1, sort_keys=True, allow_nan=False) + "\n")
  print(f"record: {target}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

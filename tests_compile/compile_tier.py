"""Compile tier: XLA compiles a program for an H100/H200 on a CPU-only machine,
and the compiled program says what would run there.

The lowering tier (`pallas_kernels.lowering`) stops before LLVM and ptxas. Here XLA runs its
whole GPU pipeline (HLO passes, fusion, buffer assignment, LLVM -> PTX -> ptxas
for its own kernels, Triton for the generic Pallas kernels, Mosaic GPU's own
ptxas run) against a device described by a TargetConfig textproto
(`gpu_targets/h100.txtpb`, `gpu_targets/h200.txtpb`), through
`jax.experimental.topologies.get_topology_desc(platform="cuda", ...)`; no GPU and
no driver are needed. It needs the CUDA PJRT plugin and the CUDA compiler wheel
(`.venv-cuda`, made by `tools/compile_tier/setup.sh`); importing this module
does not, only `compile_for_hopper` does.

  * `compile_for_hopper(fn, *args, device=H200, donate_argnums=(), **static)`:
    traces `fn` (or a function already under `jax.jit`, with its own static and
    donated arguments) on ShapeDtypeStructs placed on the Hopper topology's
    device, under `lowering.abstract_gpu_mesh` (so the kernels' wrappers build
    for cuda), compiles it, and returns a `CompiledProgram`.
  * `CompiledProgram`: the `jax.stages.Compiled`, its optimized HLO text, XLA's
    thunk sequence (every launch with its grid), and what the compile printed,
    with readers: `copies()` (copy, copy-start and fusions that only move bytes:
    slices, dynamic slices, transposes, concatenations, pads; with sizes),
    `aliases()` (which parameter each output reuses), `launches()` (kernel name,
    grid, threads, shared memory), `ptxas()` (registers and spill bytes of each
    Mosaic GPU kernel, from `MOSAIC_GPU_DUMP_PTXAS=1`), `temp_bytes`.
  * `parse_*`: the same readers on text (tested without the plugin).

Still needs a GPU: TMA descriptors, deadlocks, races, numbers, speed.

Verified with jax/jaxlib 0.12.0.1 + jax-cuda12-plugin/pjrt 0.12.0.1 and
nvidia-cuda-nvcc-cu12 12.9 (`tools/compile_tier/requirements.txt`).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import math
import os
import pathlib
import re
import sys
import tempfile
import time

import jax

from pallas_kernels import lowering

# Constants ------------------------------------------------------------------

H100 = lowering.H100
H200 = lowering.H200
_TARGET_FILES = {H100[0]: "h100.txtpb", H200[0]: "h200.txtpb"}
_TARGET_DIR = pathlib.Path(__file__).resolve().parent / "gpu_targets"

# Bytes per element of HLO's element types (sub-byte types round up).
_ELEMENT_BYTES = {"pred": 1, "token": 0, "bf16": 2, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b(pred|token|bf16|[suf]\d+|f8e\w+?|f4e\w+?|c64|c128)\[([\d,]*)\]")
# Ops that only rearrange their operands' bytes, and those that move nothing
# (views, constants); a fusion made of these alone, at least one of the first
# kind, materialises a copy.
_MOVE_OPS = frozenset({"copy", "slice", "dynamic-slice", "transpose", "concatenate",
                       "pad", "reverse"})
_VIEW_OPS = frozenset({"parameter", "constant", "bitcast", "reshape", "broadcast",
                       "get-tuple-element", "tuple", "iota", "convert"})
# Attributes naming the computations a control-flow op runs.
_CONTROL_ATTRS = re.compile(
    r"\b(?:body|condition|true_computation|false_computation)=%([\w.\-]+)"
    r"|\bbranch_computations=\{([^}]*)\}")


def _element_bytes(dtype: str) -> float:
  if dtype in _ELEMENT_BYTES:
    return _ELEMENT_BYTES[dtype]
  if dtype.startswith(("f8", "f4")):
    return 1 if dtype.startswith("f8") else 0.5
  bits = int(re.sub(r"\D", "", dtype))
  return bits / 8


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape string (`bf16[2,8]{1,0}`, or a tuple: the sum)."""
  total = 0.0
  for dtype, dims in _ARRAY.findall(shape):
    total += _element_bytes(dtype) * math.prod(int(d) for d in dims.split(",") if d)
  return int(math.ceil(total))


# HLO text ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One HLO instruction: `%name = shape opcode(operands), attributes`."""

  name: str
  shape: str
  opcode: str
  text: str  # the whole line

  @property
  def bytes(self) -> int:
    return shape_bytes(self.shape)

  def attr(self, key: str) -> str | None:
    m = re.search(rf"\b{re.escape(key)}=%?([\w.\-]+)", self.text)
    return m.group(1) if m else None

  @property
  def op_name(self) -> str | None:
    m = re.search(r'op_name="([^"]*)"', self.text)
    return m.group(1) if m else None


_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s")


def _split_shape(rest: str) -> tuple[str, str]:
  """`(shape, remainder)` of `rest`, whose shape may be a parenthesised tuple."""
  if not rest.startswith("("):
    shape, _, tail = rest.partition(" ")
    return shape, tail
  depth = 0
  for i, ch in enumerate(rest):
    depth += ch == "("
    depth -= ch == ")"
    if depth == 0:
      return rest[:i + 1], rest[i + 1:].lstrip()
  return rest, ""


@dataclasses.dataclass(frozen=True)
class HloModule:
  """A parsed HLO module text: computations by name, the entry's name, header."""

  header: str
  entry: str
  computations: dict[str, tuple[Instruction, ...]]

  def control_flow(self) -> list[str]:
    """The entry and every computation reached from it through while, conditional
    and call (not fused computations, reducers or scatter combiners)."""
    seen, todo = [], [self.entry]
    while todo:
      name = todo.pop()
      if name in seen or name not in self.computations:
        continue
      seen.append(name)
      for ins in self.computations[name]:
        for m in _CONTROL_ATTRS.finditer(ins.text):
          if m.group(1):
            todo.append(m.group(1))
          else:
            todo += [c.strip().lstrip("%") for c in m.group(2).split(",") if c.strip()]
        if ins.opcode in ("call", "async-start") and ins.attr("calls"):
          todo.append(ins.attr("calls"))
    return seen


def parse_hlo(text: str) -> HloModule:
  """Parses an HLO module's text (`compiled.as_text()`)."""
  header, entry, comps, current, body = "", "", {}, None, []
  for line in text.splitlines():
    if line.startswith("HloModule"):
      header = line
      continue
    m = _HEADER.match(line)
    if m and line.rstrip().endswith("{"):
      current, body = m.group(2), []
      if m.group(1):
        entry = current
      continue
    if current is None:
      continue
    if line.startswith("}"):
      comps[current] = tuple(body)
      current = None
      continue
    m = _INSTRUCTION.match(line)
    if m:
      shape, tail = _split_shape(m.group(2))
      op = re.match(r"([a-z][\w\-]*)\(", tail)
      body.append(Instruction(m.group(1), shape, op.group(1) if op else "", line))
  return HloModule(header=header, entry=entry, computations=comps)


@dataclasses.dataclass(frozen=True)
class Copy:
  """A buffer the program materialises by moving bytes.

  Attributes:
    name: the HLO instruction.
    kind: `copy`, `copy-start`, or `fusion(<ops>)` (the moving ops it fuses) or
      the bare moving op.
    shape: its output shape.
    bytes: bytes written.
    computation: where it runs (the entry or a loop body / branch).
    op_name: the JAX operation it came from (HLO metadata), if recorded.
  """

  name: str
  kind: str
  shape: str
  bytes: int
  computation: str
  op_name: str | None


def parse_copies(text: str, *, min_bytes: int = 0) -> list[Copy]:
  """Every copy in the control flow of an optimized HLO module, largest first:
  `copy`, `copy-start` (async copies), bare slices/transposes/concatenations/pads,
  and fusions that only move bytes (e.g. `wrapped_slice`: a layer cut out of a
  stacked pool). In-place updates (dynamic-update-slice, scatter) are no copies;
  XLA adds a `copy` where it cannot do one in place."""
  module = parse_hlo(text)
  found = []
  for comp in module.control_flow():
    for ins in module.computations[comp]:
      kind = None
      if ins.opcode == "copy-start":
        kind, size = "copy-start", shape_bytes(_split_shape(ins.shape[1:])[0])
      elif ins.opcode in _MOVE_OPS:
        kind, size = ins.opcode, ins.bytes
      elif ins.opcode == "fusion" and "address_computation" not in ins.text:
        ops = {i.opcode for i in module.computations.get(ins.attr("calls") or "", ())}
        moves = ops & _MOVE_OPS
        if moves and ops <= _MOVE_OPS | _VIEW_OPS:
          kind, size = f"fusion({','.join(sorted(moves))})", ins.bytes
      if kind is not None and size >= min_bytes:
        found.append(Copy(ins.name, kind, ins.shape, size, comp, ins.op_name))
  return sorted(found, key=lambda c: -c.bytes)


@dataclasses.dataclass(frozen=True)
class Alias:
  """Output `output_index` reuses the buffer of parameter `parameter`
  (`parameter_index` inside it, if a tuple); `name` is the parameter's JAX
  path (e.g. `state.pages.k`) when the HLO metadata records one."""

  output_index: tuple[int, ...]
  parameter: int
  parameter_index: tuple[int, ...]
  kind: str  # may-alias (donation) or must-alias
  name: str
  bytes: int


def _index(s: str) -> tuple[int, ...]:
  return tuple(int(x) for x in s.replace(" ", "").split(",") if x)


def parse_parameters(text: str) -> dict[int, tuple[str, str]]:
  """Entry parameters: number -> (JAX path from metadata or HLO name, shape)."""
  module = parse_hlo(text)
  params = {}
  for ins in module.computations.get(module.entry, ()):
    if ins.opcode == "parameter":
      number = int(re.search(r"parameter\((\d+)\)", ins.text).group(1))
      params[number] = (ins.op_name or ins.name, ins.shape)
  return params


def parse_aliases(text: str) -> list[Alias]:
  """The module's `input_output_alias` (what donation produced), named."""
  module = parse_hlo(text)
  m = re.search(r"input_output_alias=\{(.*?)\}\s*(?:,\s*\w+=|$)", module.header)
  if not m:
    return []
  params = parse_parameters(text)
  out = []
  for o, p, pi, kind in re.findall(r"\{([\d,\s]*)\}:\s*\((\d+),\s*\{([\d,\s]*)\},\s*([\w-]+)\)",
                                   m.group(1)):
    name, shape = params.get(int(p), (f"parameter({p})", ""))
    out.append(Alias(_index(o), int(p), _index(pi), kind, name, shape_bytes(shape)))
  return out


# Thunks (launches) -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Launch:
  """One entry of XLA's thunk sequence.

  Attributes:
    kind: `kCustomKernel`/`kKernel` (a kernel XLA or Triton built: grid known),
      `kCustomCall` (e.g. a Mosaic GPU kernel: its grid is inside the call),
      `kCopy` (a device-to-device memcpy), `kWhile`, `kConditional`, ...
    name: the kernel's name (`decode_attention`, `loop_slice_fusion`), or `kind`.
    grid, threads: launch dimensions `(x, y, z)`, None when not a kernel.
    shared_memory: bytes of shared memory per block.
  """

  kind: str
  name: str
  grid: tuple[int, int, int] | None = None
  threads: tuple[int, int, int] | None = None
  shared_memory: int = 0

  @property
  def programs(self) -> int:
    """Blocks the grid launches (0 when unknown)."""
    return math.prod(self.grid) if self.grid else 0


_THUNK = re.compile(r"^\s*\d+:\s+(k\w+)\s+\[[^\]]*\]\s*(.*?)\s*$")
_DIMS = r"\[(\d+),\s*(\d+),\s*(\d+)\]"


def parse_thunks(text: str) -> list[Launch]:
  """The launches of a thunk sequence dump (`*.thunk_sequence.txt`), in order,
  loop bodies and branches included (a command buffer's copy is skipped)."""
  out, in_buffer = [], False
  for line in text.splitlines():
    m = _THUNK.match(line)
    if not m:
      continue
    kind, rest = m.groups()
    if kind == "kCommandBuffer":
      in_buffer = True  # its commands repeat launches listed before it
      continue
    if in_buffer and line.startswith(" "):
      continue
    in_buffer = False
    g = re.search(rf"grid:\s*{_DIMS}", rest)
    t = re.search(rf"threads:\s*{_DIMS}", rest)
    s = re.search(r"shared_memory:\s*(\d+)", rest)
    name = rest.split(" grid:")[0].strip() or kind
    out.append(Launch(kind, name, tuple(map(int, g.groups())) if g else None,
                      tuple(map(int, t.groups())) if t else None,
                      int(s.group(1)) if s else 0))
  return out


# ptxas ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PtxasReport:
  """ptxas' resource report of one function (`ptxas -v`, as Mosaic GPU prints
  it under `MOSAIC_GPU_DUMP_PTXAS=1`)."""

  function: str
  registers: int = 0
  stack_frame: int = 0
  spill_stores: int = 0
  spill_loads: int = 0

  @property
  def spill_bytes(self) -> int:
    return self.spill_stores + self.spill_loads


def parse_ptxas(text: str) -> list[PtxasReport]:
  """Every entry function ptxas compiled in `text`, in order."""
  reports: list[dict] = []
  current = None
  for line in text.splitlines():
    m = re.search(r"Compiling entry function '([^']+)'", line)
    if m:
      current = dict(function=m.group(1))
      reports.append(current)
      continue
    if current is None:
      continue
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                  line)
    if m:
      current.update(stack_frame=int(m.group(1)), spill_stores=int(m.group(2)),
                     spill_loads=int(m.group(3)))
    m = re.search(r"Used (\d+) registers", line)
    if m:
      current["registers"] = int(m.group(1))
  return [PtxasReport(**r) for r in reports]


def mosaic_kernel_hashes(text: str) -> list[str]:
  """The `kernel_hash` of every Mosaic GPU custom call in an HLO text, in order,
  distinct."""
  out = []
  for line in text.splitlines():
    if "mosaic_gpu" in line and "custom-call" in line:
      m = re.search(r'kernel_hash = "((?:\\.|[^"\\])*)"', line)
      if m and m.group(1) not in out:
        out.append(m.group(1))
  return out


# Compiling -------------------------------------------------------------------------

# ptxas reports of the Mosaic GPU kernels compiled in this process, by kernel hash.
_MOSAIC_REPORTS: dict[str, tuple[PtxasReport, ...]] = {}


def _mosaic_reports(hlo: str, output: str) -> tuple[PtxasReport, ...]:
  """Files the reports just printed under the program's new kernels; returns
  those of all its kernels. One new kernel takes every report printed (ptxas
  may report helper functions too); several take one each, in HLO order, when
  the counts agree, else each takes all (a spill shows for all of them)."""
  hashes = mosaic_kernel_hashes(hlo)
  new = [h for h in hashes if h not in _MOSAIC_REPORTS]
  reports = tuple(parse_ptxas(output))
  if len(new) > 1 and len(reports) == len(new):
    for h, r in zip(new, reports):
      _MOSAIC_REPORTS[h] = (r,)
  else:
    for h in new:
      _MOSAIC_REPORTS[h] = reports
  return tuple(r for h in hashes for r in _MOSAIC_REPORTS[h])


def target_config(device: tuple[str, int] = H200) -> str:
  """The TargetConfig textproto of `device` (`H100` or `H200`)."""
  kind = device[0]
  if kind not in _TARGET_FILES:
    raise ValueError(f"no TargetConfig for {kind!r}; known: {sorted(_TARGET_FILES)}")
  return (_TARGET_DIR / _TARGET_FILES[kind]).read_text()


@functools.lru_cache(maxsize=None)
def topology_device(device: tuple[str, int] = H200):
  """The (only) device of a one-GPU topology of `device`, made from its
  TargetConfig with the CUDA PJRT plugin; no GPU needed.

  Raises:
    RuntimeError: the CUDA plugin is not installed (use `.venv-cuda`).
  """
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel

  try:
    topo = topologies.get_topology_desc(platform="cuda", target_config=target_config(device),
                                        topology="1x1x1")
  except Exception as e:  # the plugin's absence shows as several error types
    raise RuntimeError(
        "the compile tier needs the CUDA PJRT plugin (jax-cuda12-plugin); run it with "
        ".venv-cuda/bin/python (make compile-tier, tools/compile_tier/setup.sh): "
        f"{type(e).__name__}: {e}") from e
  return topo.devices[0]


@contextlib.contextmanager
def _captured_fds():
  """Captures what is written to file descriptors 1 and 2 (C++, ptxas) into
  `box[0]` when the block ends."""
  box: list[str] = []
  libc = ctypes.CDLL(None)
  sys.stdout.flush()
  sys.stderr.flush()
  with tempfile.TemporaryFile() as tmp:
    saved = os.dup(1), os.dup(2)
    os.dup2(tmp.fileno(), 1)
    os.dup2(tmp.fileno(), 2)
    try:
      yield box
    finally:
      sys.stdout.flush()
      sys.stderr.flush()
      libc.fflush(None)
      os.dup2(saved[0], 1)
      os.dup2(saved[1], 2)
      os.close(saved[0])
      os.close(saved[1])
      tmp.seek(0)
      box.append(tmp.read().decode(errors="replace"))


@dataclasses.dataclass(frozen=True)
class CompiledProgram:
  """A program compiled for a Hopper GPU, and what XLA built.

  Attributes:
    compiled: the `jax.stages.Compiled` (not runnable here: no GPU).
    device_kind: the device it was compiled for.
    hlo: the optimized HLO module text.
    thunks: XLA's thunk sequence (one line per launch, with grids).
    output: what the compile printed on stdout/stderr (ptxas reports).
    lower_seconds, compile_seconds: wall time of trace + lower, and of compile.
    mosaic_reports: ptxas' report of each Mosaic GPU kernel in the program,
      including kernels compiled earlier in this process (Mosaic GPU compiles a
      kernel once per process and prints its report only then; they are kept
      by kernel hash, `_MOSAIC_REPORTS`).
  """

  compiled: jax.stages.Compiled
  device_kind: str
  hlo: str
  thunks: str
  output: str
  lower_seconds: float
  compile_seconds: float
  mosaic_reports: tuple[PtxasReport, ...] = ()

  def copies(self, *, min_bytes: int = 0) -> list[Copy]:
    """Copies in the program (`parse_copies`), largest first."""
    return parse_copies(self.hlo, min_bytes=min_bytes)

  def aliases(self) -> list[Alias]:
    """Inputs whose buffers outputs reuse (`parse_aliases`)."""
    return parse_aliases(self.hlo)

  def aliased_names(self) -> set[str]:
    """JAX paths (`state.pages.k`) of the aliased parameters."""
    return {a.name for a in self.aliases()}

  def launches(self, name: str | None = None) -> list[Launch]:
    """Thunks in launch order; with `name`, the kernels whose name contains it."""
    out = parse_thunks(self.thunks)
    return out if name is None else [t for t in out if name in t.name]

  def ptxas(self) -> list[PtxasReport]:
    """ptxas reports of the program's Mosaic GPU kernels (`parse_ptxas`), one
    per kernel (see `mosaic_reports`)."""
    return list(self.mosaic_reports)

  def mosaic_kernels(self) -> list[str]:
    """Hashes of the program's Mosaic GPU kernels, in HLO order, distinct."""
    return mosaic_kernel_hashes(self.hlo)

  def custom_calls(self) -> list[Instruction]:
    """Custom calls (Pallas Triton/Mosaic kernels, library calls) in the
    program's control flow."""
    module = parse_hlo(self.hlo)
    return [i for c in module.control_flow() for i in module.computations[c]
            if i.opcode == "custom-call"]

  @property
  def memory(self):
    return self.compiled.memory_analysis()

  @property
  def temp_bytes(self) -> int:
    """Scratch memory the program allocates besides inputs and outputs."""
    return int(self.memory.temp_size_in_bytes)

  @property
  def alias_bytes(self) -> int:
    """Bytes of outputs written into donated inputs' buffers."""
    return int(self.memory.alias_size_in_bytes)

  def summary(self, *, min_copy_bytes: int = 1 << 20) -> str:
    """A few lines for a failure message: memory, aliases, big copies, kernels."""
    lines = [f"{self.device_kind}: compile {self.compile_seconds:.1f} s, temp "
             f"{self.temp_bytes:,} B, aliased {self.alias_bytes:,} B"]
    lines += [f"  alias {a.name} -> output {a.output_index} ({a.bytes:,} B, {a.kind})"
              for a in self.aliases() if a.bytes >= min_copy_bytes]
    lines += [f"  copy {c.name} {c.kind} {c.shape} {c.bytes:,} B in {c.computation}"
              f" ({c.op_name})" for c in self.copies(min_bytes=min_copy_bytes)]
    lines += [f"  launch {t.name} grid={t.grid} smem={t.shared_memory}"
              for t in self.launches() if t.programs > 1 or t.kind == "kCustomCall"]
    lines += [f"  ptxas {r.function}: {r.registers} registers, {r.spill_bytes} spill bytes"
              for r in self.ptxas()]
    return "\n".join(lines)


def _on_device(tree, sharding):
  """Array-like leaves become ShapeDtypeStructs placed by `sharding`."""
  def place(x):
    if hasattr(x, "shape") and hasattr(x, "dtype"):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return x
  return jax.tree.map(place, tree)


def compile_for_hopper(fn, *args, device: tuple[str, int] = H200,
                       donate_argnums: int | tuple[int, ...] = (),
                       **static) -> CompiledProgram:
  """Compiles `fn(*args, **static)` for `device` (`H100`/`H200`) without a GPU.

  Args:
    fn: a function, or one already under `jax.jit` (e.g. `steps.decode_step`),
      whose own static and donated arguments then apply (`donate_argnums` must
      be empty).
    *args: pytrees of arrays or `jax.ShapeDtypeStruct`s (their shapes and dtypes
      are used; every leaf is placed on the topology's device).
    device: which TargetConfig (`gpu_targets/`).
    donate_argnums: for a plain `fn`, the arguments it donates.
    **static: keyword arguments, static for a plain `fn` (hashable), passed as
      declared to a jitted one.

  Returns:
    The `CompiledProgram`. The trace runs under `lowering.abstract_gpu_mesh`, so
    `lowering.target_platform()` is "cuda" and the wrappers build their GPU
    paths; `MOSAIC_GPU_DUMP_PTXAS=1` is set for the compile, whose output is
    captured at the file-descriptor level.
  """
  sharding = jax.sharding.SingleDeviceSharding(topology_device(device))
  if hasattr(fn, "trace") and hasattr(fn, "lower"):
    if donate_argnums:
      raise ValueError("fn is already jitted: declare donation in its jax.jit")
    jitted = fn
  else:
    jitted = jax.jit(fn, donate_argnums=donate_argnums, static_argnames=tuple(static))
  args = _on_device(args, sharding)
  start = time.perf_counter()
  with jax.sharding.use_abstract_mesh(lowering.abstract_gpu_mesh(device[0],
                                                                  num_cores=device[1])):
    lowered = jitted.trace(*args, **static).lower()
  lowered_at = time.perf_counter()
  previous = os.environ.get("MOSAIC_GPU_DUMP_PTXAS")
  os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
  with tempfile.TemporaryDirectory(prefix="compile_tier_") as dump:
    try:
      with _captured_fds() as out:
        compiled = lowered.compile(compiler_options={"xla_dump_to": dump})
    except Exception:
      sys.stderr.write(out[-1][-20000:] if out else "")  # what XLA/ptxas said
      raise
    finally:
      if previous is None:
        del os.environ["MOSAIC_GPU_DUMP_PTXAS"]
      else:
        os.environ["MOSAIC_GPU_DUMP_PTXAS"] = previous
    done = time.perf_counter()
    thunks = sorted(pathlib.Path(dump).glob("*.thunk_sequence.txt"))
    thunk_text = "\n".join(p.read_text() for p in thunks)
  hlo = compiled.as_text()
  return CompiledProgram(compiled=compiled, device_kind=device[0], hlo=hlo, thunks=thunk_text,
                         output=out[0], lower_seconds=lowered_at - start,
                         compile_seconds=done - lowered_at,
                         mosaic_reports=_mosaic_reports(hlo, out[0]))

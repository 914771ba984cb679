"""Where a kernel is being built for, and lowering against an abstract Hopper GPU.

JAX lowers Pallas kernels for `cuda` on a CPU-only machine when the trace runs
under an `AbstractMesh` whose `AbstractDevice` is a GPU (entered with
`jax.sharding.use_abstract_mesh`) and `.lower(lowering_platforms=("cuda",))` is
asked for. That runs the Pallas -> Triton and Pallas -> Mosaic GPU lowering passes
(layout inference, TMA and shared-memory checks) and stops before LLVM/ptxas:
passing is necessary, not sufficient.

`target_platform()` is what the kernels' wrappers check to refuse, at trace time,
shapes that cannot lower; `abstract_gpu_mesh` / `lower_for_gpu` are the lowering
tier's entry points (the compile tier, `tests_compile/compile_tier.py`, compiles on from there). Verified with JAX 0.12.0.1 and 0.11.2.
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import jax

# Constants ------------------------------------------------------------------

# device_kind strings as `jax.devices()[0].device_kind` reports them; SM counts.
H100 = ("NVIDIA H100 80GB HBM3", 132)
H200 = ("NVIDIA H200", 132)
HOPPER_DEVICES = (H100, H200)


# Target ---------------------------------------------------------------------


def target_platform() -> str:
  """Platform of the trace in progress: the abstract mesh's device if one is
  entered (`use_abstract_mesh`), else the default backend ("gpu" -> "cuda")."""
  mesh = jax.sharding.get_abstract_mesh()
  device = getattr(mesh, "abstract_device", None)
  platform = device.platform if device is not None else jax.default_backend()
  return "cuda" if platform == "gpu" else platform


def is_gpu_target() -> bool:
  return target_platform() in ("cuda", "rocm")


def lowerable_impls(gpu_preference: tuple[str, ...], problem, *, platform: str | None = None,
                    **shape) -> tuple[str, ...]:
  """The impls for which `problem(impl, platform=..., **shape)` reports nothing, by
  `gpu_preference` on a GPU platform, "xla" first elsewhere."""
  platform = platform or target_platform()
  order = gpu_preference if platform in ("cuda", "rocm") else ("xla", "pallas", "mosaic")
  return tuple(i for i in order if problem(i, platform=platform, **shape) is None)


def abstract_gpu_mesh(device_kind: str = H200[0], *, num_cores: int = 132,
                      platform: str = "cuda") -> jax.sharding.AbstractMesh:
  """A one-device `AbstractMesh` of an abstract GPU (no GPU needed)."""
  device = jax.sharding.AbstractDevice(device_kind=device_kind,
                                       num_cores=num_cores, platform=platform)
  return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)


def lower_for_gpu(fn, *args, device_kind: str = H200[0], num_cores: int = 132):
  """`jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))` against an
  abstract GPU; `args` are usually `jax.ShapeDtypeStruct`s. Returns the
  `jax.stages.Lowered`; raises what the lowering raises."""
  with jax.sharding.use_abstract_mesh(
      abstract_gpu_mesh(device_kind, num_cores=num_cores)):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


# Interpreter ------------------------------------------------------------------

# XLA:CPU thread pools the Mosaic GPU interpreter needs (see
# `reserve_cpu_threads_for_gpu_interpreter`).
INTERPRETER_CPU_THREADS = 8
_POOL_ENV = ("PJRT_NPROC", "NPROC")  # read by XLA's DefaultThreadPoolSize, in order


def _cpu_pool_threads() -> int:
  """Threads of XLA:CPU's intra-op pool: counted (`/proc`) once the client exists,
  else what one created now would get (`PJRT_NPROC`, `NPROC`, the cores)."""
  if _cpu_client_created():
    try:
      tasks = os.listdir("/proc/self/task")
      names = []
      for t in tasks:
        try:
          with open(f"/proc/self/task/{t}/comm") as f:
            names.append(f.read())
        except OSError:
          continue  # a thread that ended meanwhile
      counted = sum("XLAEigen" in n for n in names)
      if counted:
        return counted
    except OSError:
      pass
  for name in _POOL_ENV:
    value = os.environ.get(name, "")
    if value.isdigit() and int(value) > 0:
      return int(value)
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # not Linux
    return os.cpu_count() or 1


def _cpu_client_created() -> bool:
  from jax._src import xla_bridge  # private; `_backends` in 0.11.2 and 0.12

  return bool(getattr(xla_bridge, "_backends", None))


def reserve_cpu_threads_for_gpu_interpreter(
    threads: int = INTERPRETER_CPU_THREADS) -> bool:
  """Makes XLA:CPU's thread pools at least `threads` wide (`PJRT_NPROC`) for the
  Mosaic GPU interpreter, if the CPU client does not exist yet and neither
  `PJRT_NPROC` nor `NPROC` is set; returns whether they will be that wide.

  Why: the interpreter runs each warpgroup as its own CPU program whose barrier
  waits block an XLA:CPU thread; with one thread per core (2 on a small machine)
  the other warpgroup may never get one, and the kernel hangs.
  """
  if _cpu_pool_threads() >= threads:
    return True
  if _cpu_client_created() or any(os.environ.get(n) for n in _POOL_ENV):
    return False  # too late, or the user's own choice
  os.environ["PJRT_NPROC"] = str(threads)
  return True


_warned_threads: list[bool] = []


def gpu_interpret_params(**kwargs):
  """`plgpu.InterpretGPUParams(**kwargs)` minus the keywords this JAX lacks (e.g.
  `on_race` before 0.12: races are then recorded for `get_races()`, not raised)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # GPU-only import

  if _cpu_pool_threads() < INTERPRETER_CPU_THREADS and not _warned_threads:
    _warned_threads.append(True)
    warnings.warn(
        f"the Mosaic GPU interpreter may deadlock with XLA:CPU thread pools of "
        f"{_cpu_pool_threads()} threads (a warpgroup blocked in a barrier wait "
        f"holds one); set PJRT_NPROC={INTERPRETER_CPU_THREADS} before JAX creates "
        f"its CPU client, or call "
        f"lowering.reserve_cpu_threads_for_gpu_interpreter() first", stacklevel=2)
  known = {f.name for f in dataclasses.fields(plgpu.InterpretGPUParams)}
  return plgpu.InterpretGPUParams(
      **{k: v for k, v in kwargs.items() if k in known})


def interpreter_state():
  """The Mosaic GPU interpreter module (`reset_gpu_interpret_mode_state`,
  `get_races`), private in every JAX version seen (0.11.2, 0.12)."""
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as mi
  return mi

"""Where a kernel is being built for, and lowering against an abstract Hopper GPU.

JAX lowers Pallas kernels for `cuda` on a CPU-only machine when the trace runs
under an `AbstractMesh` whose `AbstractDevice` is a GPU (entered with
`jax.sharding.use_abstract_mesh`) and `.lower(lowering_platforms=("cuda",))` is
asked for. That runs the Pallas -> Triton and Pallas -> Mosaic GPU lowering passes
(layout inference, TMA and shared-memory checks) and stops before LLVM/ptxas:
passing is necessary, not sufficient.

  * `target_platform()`: the platform the trace in progress builds for ("cuda"
    under an abstract GPU mesh, else the default backend, "gpu" read as "cuda").
    The kernels' wrappers use it to refuse, at trace time and with a clear error,
    shapes whose kernel cannot lower there.
  * `abstract_gpu_mesh(device_kind)` / `lower_for_gpu(fn, *args)`: the lowering
    tier's entry points (`tests/kernels/test_lowering.py`, `tests/model/test_lowering.py`;
    `pallas_kernels.compile_tier` compiles on from there).
  * `gpu_interpret_params(...)`: `plgpu.InterpretGPUParams` with the keywords the
    installed JAX knows (`on_race` is new in 0.12; the GPU machine runs 0.11.2).

Which impl builds for a shape: `paged_attention.lowerable_decode_impls` /
`decode_impl_problem` and `permute_blocks.lowerable_permute_impls` /
`permute_impl_problem` (the wrappers raise the same reasons at trace time).

Verified with JAX 0.12.0.1 and 0.11.2.
"""

from __future__ import annotations

import dataclasses

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
  """The impls for which `problem(impl, platform=..., **shape)` reports nothing.

  Ordered by `gpu_preference` on a GPU platform, "xla" first elsewhere; `platform`
  defaults to the trace's target (`target_platform()`).
  """
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


def gpu_interpret_params(**kwargs):
  """`plgpu.InterpretGPUParams(**kwargs)` minus the keywords this JAX lacks
  (e.g. `on_race`, added after 0.11.2; without it races are recorded, not
  raised, and `get_races()` reports them)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # GPU-only import

  known = {f.name for f in dataclasses.fields(plgpu.InterpretGPUParams)}
  return plgpu.InterpretGPUParams(
      **{k: v for k, v in kwargs.items() if k in known})


def interpreter_state():
  """The Mosaic GPU interpreter module (`reset_gpu_interpret_mode_state`,
  `get_races`), private in every JAX version seen (0.11.2, 0.12)."""
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as mi
  return mi

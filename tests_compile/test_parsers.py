"""The compile tier's readers of XLA's text (`tests_compile.compile_tier.parse_*`)
on small hand-written modules, thunk sequences and ptxas reports; no compile."""

from __future__ import annotations

import textwrap

from tests_compile import compile_tier as ct

_MODULE = textwrap.dedent("""\
    HloModule jit_step, is_scheduled=true, input_output_alias={ {0}: (1, {}, may-alias), {2}: (3, {}, must-alias) }, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

    %cut (p0: bf16[4,8,16]) -> bf16[1,8,16] {
      %p0 = bf16[4,8,16]{2,1,0} parameter(0)
      ROOT %slice.1 = bf16[1,8,16]{2,1,0} slice(%p0), slice={[1:2], [0:8], [0:16]}
    }

    %math (p0.1: f32[64]) -> f32[64] {
      %p0.1 = f32[64]{0} parameter(0)
      ROOT %add.1 = f32[64]{0} add(%p0.1, %p0.1)
    }

    %write (p0.2: bf16[4,8,16], p1.2: bf16[1,8,16], p2.2: s32[]) -> bf16[4,8,16] {
      %p0.2 = bf16[4,8,16]{2,1,0} parameter(0)
      %p1.2 = bf16[1,8,16]{2,1,0} parameter(1)
      %p2.2 = s32[] parameter(2)
      %zero = s32[] constant(0)
      ROOT %dus = bf16[4,8,16]{2,1,0} dynamic-update-slice(%p0.2, %p1.2, %p2.2, %zero, %zero)
    }

    %body (t: (s32[], f32[1024])) -> (s32[], f32[1024]) {
      %t = (s32[], f32[1024]{0}) parameter(0)
      %i = s32[] get-tuple-element(%t), index=0
      %x = f32[1024]{0} get-tuple-element(%t), index=1
      %cs = (f32[1024]{0}, f32[1024]{0}, u32[]) copy-start(%x)
      %cd = f32[1024]{0} copy-done(%cs)
      ROOT %r = (s32[], f32[1024]{0}) tuple(%i, %cd)
    }

    %cond (t.1: (s32[], f32[1024])) -> pred[] {
      %t.1 = (s32[], f32[1024]{0}) parameter(0)
      ROOT %lt = pred[] constant(true)
    }

    ENTRY %main (a.1: f32[64], pages.1: bf16[4,8,16], x.1: f32[1024], v.1: bf16[4,8,16]) -> (f32[64], bf16[4,8,16], bf16[4,8,16]) {
      %a.1 = f32[64]{0} parameter(0), metadata={op_name="a"}
      %pages.1 = bf16[4,8,16]{2,1,0} parameter(1), metadata={op_name="state.pages.k"}
      %x.1 = f32[1024]{0} parameter(2)
      %v.1 = bf16[4,8,16]{2,1,0} parameter(3), metadata={op_name="state.pages.v"}
      %copy.7 = f32[64]{0} copy(%a.1)
      %wrapped_slice = bf16[1,8,16]{2,1,0} fusion(%pages.1), kind=kLoop, calls=%cut, metadata={op_name="jit(step)/slice"}
      %loop_add_fusion = f32[64]{0} fusion(%copy.7), kind=kLoop, calls=%math
      %dus_fusion = bf16[4,8,16]{2,1,0} fusion(%pages.1, %wrapped_slice, %x.1), kind=kLoop, calls=%write
      %init = (s32[], f32[1024]{0}) tuple(%a.1, %x.1)
      %loop = (s32[], f32[1024]{0}) while(%init), condition=%cond, body=%body
      ROOT %out = (f32[64]{0}, bf16[4,8,16]{2,1,0}, bf16[4,8,16]{2,1,0}) tuple(%loop_add_fusion, %dus_fusion, %v.1)
    }
    """)


def test_shape_bytes():
  assert ct.shape_bytes("bf16[2,8]{1,0}") == 32
  assert ct.shape_bytes("(f32[4]{0}, s8[3]{0}, pred[])") == 16 + 3 + 1
  assert ct.shape_bytes("f8e4m3fn[1,8,131072,16,128]{4,3,2,1,0}") == 8 * 131072 * 16 * 128
  assert ct.shape_bytes("s32[]") == 4
  assert ct.shape_bytes("s4[3]") == 2


def test_parse_hlo_finds_the_control_flow():
  module = ct.parse_hlo(_MODULE)
  assert module.entry == "main"
  assert set(module.computations) == {"cut", "math", "write", "body", "cond", "main"}
  assert sorted(module.control_flow()) == ["body", "cond", "main"]
  ops = [i.opcode for i in module.computations["main"]]
  assert ops.count("parameter") == 4 and "while" in ops and ops[-1] == "tuple"


def test_copies_are_copies_and_byte_moving_fusions():
  copies = {c.name: c for c in ct.parse_copies(_MODULE)}
  assert set(copies) == {"copy.7", "wrapped_slice", "cs"}  # not the add, not the update
  assert copies["wrapped_slice"].kind == "fusion(slice)"
  assert copies["wrapped_slice"].bytes == 8 * 16 * 2
  assert copies["wrapped_slice"].op_name == "jit(step)/slice"
  assert copies["cs"].kind == "copy-start" and copies["cs"].bytes == 4096
  assert copies["cs"].computation == "body"
  assert [c.name for c in ct.parse_copies(_MODULE, min_bytes=257)] == ["cs"]


def test_aliases_are_named_by_their_jax_path():
  aliases = ct.parse_aliases(_MODULE)
  assert [(a.output_index, a.parameter, a.kind, a.name, a.bytes) for a in aliases] == [
      ((0,), 1, "may-alias", "state.pages.k", 4 * 8 * 16 * 2),
      ((2,), 3, "must-alias", "state.pages.v", 4 * 8 * 16 * 2),
  ]
  assert ct.parse_parameters(_MODULE)[2] == ("x.1", "f32[1024]{0}")
  assert ct.parse_aliases(_MODULE.replace("input_output_alias", "no_alias")) == []


_THUNKS = textwrap.dedent("""\
    001: kCopy         [source        | next=003 (1)] kCopy
    002: kCustomKernel [source        | next=003 (2)] loop_pad_fusion grid: [33, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
    003: kCustomKernel [prev=002 (1)  | next=004 (1)] paged_attention grid: [1, 8, 33] threads: [128, 1, 1]  shared_memory: 50768 bytes
    004: kWhile        [prev=003 (1)  | sink        ]
    condition:
        005: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
      body:
        006: kCustomCall   [source       | sink        ] kCustomCall

    000: kCommandBuffer [source | sink]
        002: kCustomKernel [source | sink] loop_pad_fusion grid: [33, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
    """)


def test_thunks_list_every_launch_once():
  launches = ct.parse_thunks(_THUNKS)
  assert [t.kind for t in launches] == ["kCopy", "kCustomKernel", "kCustomKernel", "kWhile",
                                        "kCustomKernel", "kCustomCall"]
  attn = launches[2]
  assert (attn.name, attn.grid, attn.threads, attn.shared_memory, attn.programs) == (
      "paged_attention", (1, 8, 33), (128, 1, 1), 50768, 264)
  assert launches[0].name == "kCopy" and launches[0].grid is None and launches[0].programs == 0


_PTXAS = textwrap.dedent("""\
    ptxas /tmp/x, line 12; info    : Potential out of bound access
    ptxas info    : 0 bytes gmem
    ptxas info    : Compiling entry function 'anonymous_mosaic_gpu_kernel' for 'sm_90a'
    ptxas info    : Function properties for anonymous_mosaic_gpu_kernel
        0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
    ptxas info    : Used 232 registers, used 16 barriers, 1 bytes smem
    ptxas warning : Registers are spilled to local memory in function 'k2', 572 bytes spill stores, 452 bytes spill loads
    ptxas info    : Compiling entry function 'k2' for 'sm_90a'
    ptxas info    : Function properties for k2
        256 bytes stack frame, 572 bytes spill stores, 452 bytes spill loads
    ptxas info    : Used 255 registers, used 2 barriers, 256 bytes cumulative stack size
    """)


def test_ptxas_reports():
  assert ct.parse_ptxas(_PTXAS) == [
      ct.PtxasReport("anonymous_mosaic_gpu_kernel", registers=232),
      ct.PtxasReport("k2", registers=255, stack_frame=256, spill_stores=572, spill_loads=452),
  ]
  assert ct.parse_ptxas(_PTXAS)[1].spill_bytes == 1024
  assert ct.parse_ptxas("nothing compiled") == []


def test_mosaic_kernel_hashes():
  line = ('  %m = (f32[1]{0}) custom-call(%a), custom_call_target="mosaic_gpu_v2", '
          'backend_config={kernel_hash = "\\89\\C4\\"x", module = "ML"}')
  assert ct.mosaic_kernel_hashes("\n".join([line, line])) == ['\\89\\C4\\"x']
  assert ct.mosaic_kernel_hashes(_MODULE) == []


def test_target_configs_describe_hopper():
  for device, memory in ((ct.H100, 85520809984), (ct.H200, 150754820096)):
    text = ct.target_config(device)
    assert f'device_description_str: "{device[0]}"' in text
    assert f"core_count: {device[1]}" in text
    assert "cuda_compute_capability { major: 9 minor: 0 }" in text
    assert f"device_memory_size: {memory}" in text

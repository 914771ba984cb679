"""Continuous batching: `Scheduler` runs one mixed forward pass per step.

`scheduler` is the step loop and the requests' lifecycle; its parts decide the KV
side; `request`, `sampling_params`, `parallel_sampling`, `stop_strings` and
`streaming` describe requests and their output; `executor` is the model behind a step.
"""

from paged_kv.scheduler.executor import (DryExecutor, Executor, ModelExecutor, attach_state,
                                         attached_state, reserved_growth)
from paged_kv.scheduler.parallel_sampling import SampleId
from paged_kv.scheduler.sampling_params import SamplingParams
from paged_kv.scheduler.scheduler import (Phase, Request, Scheduler, SchedulerBroken,
                                          SchedulerConfig, SchedulerStalled, SchedulerStats,
                                          StepReport, UnknownRequest)
from paged_kv.scheduler.swap import SwappedKV, swap_in, swap_out

__all__ = ["DryExecutor", "Executor", "ModelExecutor", "Phase", "Request", "SampleId",
           "SamplingParams", "Scheduler", "SchedulerBroken", "SchedulerConfig",
           "SchedulerStalled", "SchedulerStats", "StepReport", "SwappedKV", "UnknownRequest",
           "attach_state", "attached_state", "reserved_growth", "swap_in", "swap_out"]

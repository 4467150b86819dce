"""The scheduler: requests, sampling parameters, the unified Scheduler and its wire messages.

Pure CPU bookkeeping: imports kvcache and msgspec only (never torch or ray).
"""
from tierserve.scheduler.messages import (
    CachedRequestData, ClientChannelCodec, EngineChannelCodec, EngineCoreOutput,
    EngineCoreOutputs, EngineCoreRequest, MalformedFrameError, ModelRunnerOutput, NewRequestData,
    SampleLogprobs, SchedulerOutput, ShutdownWorker, TierCopyBatch, FlushTiers, WorkerChannelCodec,
    WorkerError,
)
from tierserve.scheduler.params import FinishReason, RequestStatus, SamplingParams
from tierserve.scheduler.request import Request
from tierserve.scheduler.scheduler import Scheduler

__all__ = [
    "CachedRequestData", "ClientChannelCodec", "EngineChannelCodec", "EngineCoreOutput",
    "EngineCoreOutputs", "EngineCoreRequest", "MalformedFrameError", "ModelRunnerOutput",
    "NewRequestData", "SampleLogprobs", "SchedulerOutput", "ShutdownWorker", "TierCopyBatch",
    "FlushTiers",
    "WorkerChannelCodec", "WorkerError", "FinishReason", "RequestStatus", "SamplingParams",
    "Request", "Scheduler",
]

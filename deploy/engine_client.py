"""The client side of one engine deployment: `RayEngineClient`, an engine client for runtime's
`LLM` and `AsyncLLM` that holds the engine actor's handle, streams its outputs and turns Ray's
errors into the engine's own."""
from __future__ import annotations

import asyncio
import logging
import os

import ray
from ray.util.placement_group import remove_placement_group

from tierserve.deploy.deployment_names import actor_name, ensure_ray, holder_name, join, lookup
from tierserve.deploy.deployment_start import start_deployment
from tierserve.deploy.loop_thread import LoopThread
from tierserve.deploy.watchdog import Liveness, next_or_dead
from tierserve.runtime import envs
from tierserve.runtime.client import HEARTBEAT_S
from tierserve.runtime.config import EngineConfig
from tierserve.runtime.errors import EngineDeadError
from tierserve.runtime.outputs import Outstanding
from tierserve.scheduler.messages import ClientChannelCodec, EngineCoreRequest

__all__ = ["RayEngineClient"]

log = logging.getLogger("tierserve.deploy")

# A call to the engine actor waits this long at least (more with a longer step timeout).
_CALL_TIMEOUT_S = 30.0


class RayEngineClient:
    """The client side of one deployment: the engine actor's handle. It pickles (as the
    handle), so a connected client travels into Ray tasks and actors.

    Its requests carry an owner token of its own (a fresh one in each process it is unpickled
    in): its aborts and stops reach only requests it started. Every call has a deadline, and a
    stream fails once the engine has not answered a heartbeat for the step timeout (its
    process stopped or hung). Errors never carry Ray's text (tracebacks, pids, addresses,
    actor ids): that is logged here, and chained as the exception's cause."""

    def __init__(self, actor, name: str | None = None, *, config: EngineConfig | None = None,
                 pg=None) -> None:
        self.actor = actor
        self.name = name
        self.config = config  # set on an owned engine
        self._pg = pg  # an owned engine's placement group, removed with it
        self._codec = ClientChannelCodec()
        self._tokenizer = None
        self._loop: LoopThread | None = None  # stream_batch's, started on first use
        self._owner = os.urandom(8).hex()
        self.step_timeout_s = _CALL_TIMEOUT_S
        info = self.info()
        self.vocab_size = info["vocab_size"]
        self.max_model_len = info["max_model_len"]
        self.step_timeout_s = info.get("step_timeout_s", _CALL_TIMEOUT_S)
        self._tokenizer_path = info["tokenizer_path"]

    @classmethod
    def start(cls, config: EngineConfig) -> "RayEngineClient":
        """An anonymous deployment owned by this client. A model or TP size that cannot work
        fails before a Ray instance starts for it."""
        from tierserve.runtime.engine_setup import check_model
        check_model(config)
        ensure_ray()
        actor, pg = start_deployment(config)
        return cls(actor, config=config, pg=pg)

    @classmethod
    def connect(cls, name: str, namespace: str | None = None) -> "RayEngineClient":
        ns = namespace or envs.default_namespace()
        join(name, namespace)
        actor = lookup(actor_name(name), ns)
        if actor is None:
            if lookup(holder_name(name), ns) is not None:
                raise EngineDeadError(f"deployment {name!r} is dead: its engine actor is gone "
                                      f"(`tierserve stop {name}` cleans up; serving it again "
                                      f"replaces it)")
            raise ValueError(f"no tierserve deployment named {name!r} in namespace {ns!r}")
        return cls(actor, name)

    def __reduce__(self):
        return (RayEngineClient, (self.actor, self.name))

    @property
    def tokenizer(self):
        """The engine's tokenizer, loaded here on first use (None for a model without one)."""
        if self._tokenizer is None:
            from tierserve.runtime.tokenizer import load_model_tokenizer
            self._tokenizer = load_model_tokenizer(self._tokenizer_path)
        return self._tokenizer

    @property
    def _deadline_s(self) -> float:
        """How long a call may wait: a call waits behind at most a step."""
        return max(_CALL_TIMEOUT_S, self.step_timeout_s + 10.0)

    async def generate(self, requests: list[EngineCoreRequest], *, hold: bool = False):
        """hold: an offline batch, queued whole (AsyncEngine.generate)."""
        stream = self.actor.generate.options(num_returns="streaming").remote(
            requests, self._owner, hold)
        pending = Outstanding(requests)
        alive = Liveness(self.step_timeout_s)
        heartbeat = asyncio.get_running_loop().create_task(self._heartbeat(pending, alive))
        try:
            while True:
                try:
                    ref = await next_or_dead(stream, alive)
                except StopAsyncIteration:
                    return
                batch = self._codec.decode(await ref).outputs
                alive.beat()
                pending.update(batch)
                yield batch
        except ray.exceptions.RayActorError as e:
            raise _dead("the engine actor died", e) from e
        except ray.exceptions.RayError as e:
            raise _failed(e) from e
        finally:
            heartbeat.cancel()
            if pending:
                ray.cancel(stream)
                self.actor.abort.remote(list(pending), self._owner)

    async def _heartbeat(self, pending: Outstanding, alive: Liveness) -> None:
        """Renews the leases of this stream's unfinished requests while it is consumed; each
        answer shows the engine alive."""
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            alive.watch(self.actor.renew.remote(list(pending)))

    def stream_batch(self, requests: list[EngineCoreRequest]):
        """generate()'s batches for synchronous callers (LLM), driven on a loop thread of this
        client's: one stream implementation, with generate's heartbeats and liveness watch."""
        if self._loop is None:
            self._loop = LoopThread("tierserve-engine-client")
        yield from self._loop.iterate(self.generate(requests, hold=True))

    def abort(self, request_ids: list[str]) -> None:
        self.actor.abort.remote(list(request_ids), self._owner)

    def stop(self, seqs: list[tuple[str, int]]) -> None:
        self.actor.stop.remote(list(seqs), self._owner)

    stop_sequences = stop

    def abort_now(self, names: list[str]) -> list[str]:
        """The operator's abort, waited for: requests named by id or label, whoever started
        them; the engine ids aborted."""
        return self._get(self.actor.abort_named.remote(list(names)))

    def list_requests(self) -> list[dict]:
        return self._get(self.actor.list_requests.remote())

    def stats(self) -> dict:
        return self._get(self.actor.stats.remote())

    async def stats_async(self) -> dict:
        return await self._get_async(self.actor.stats.remote())

    def info(self) -> dict:
        return self._get(self.actor.info.remote())

    def health(self) -> bool:
        """True, or EngineDeadError (the engine died, its actor is gone, or it does not
        answer)."""
        return self._get(self.actor.health.remote())

    async def health_async(self) -> bool:
        return await self._get_async(self.actor.health.remote())

    def reset_prefix_cache(self) -> bool:
        return self._get(self.actor.reset_prefix_cache.remote())

    def shutdown(self) -> None:
        """Stops an owned engine; a connected client just lets go of the deployment."""
        if self._loop is not None:
            self._loop.stop()
            self._loop = None
        if self._pg is None or self.actor is None:
            return
        try:
            ray.get(self.actor.shutdown.remote(), timeout=30)
        except Exception as e:
            log.warning("engine did not shut down cleanly: %s", e)
        ray.kill(self.actor, no_restart=True)
        remove_placement_group(self._pg)
        self.actor = None

    def _get(self, ref):
        """ray.get within the deadline; a dead or silent engine actor is EngineDeadError."""
        try:
            return ray.get(ref, timeout=self._deadline_s)
        except ray.exceptions.RayActorError as e:
            raise _dead("the engine actor is gone", e) from e
        except ray.exceptions.GetTimeoutError as e:
            raise _dead(f"the engine actor did not answer in {self._deadline_s:.0f} s",
                        e) from e
        except ray.exceptions.RayError as e:
            raise _failed(e) from e

    async def _get_async(self, ref):
        """_get without a thread, for an event loop (its caller may set a shorter deadline)."""
        try:
            return await asyncio.wait_for(asyncio.wrap_future(ref.future()), self._deadline_s)
        except ray.exceptions.RayActorError as e:
            raise _dead("the engine actor is gone", e) from e
        except ray.exceptions.RayError as e:
            raise _failed(e) from e


def _dead(message: str, cause: BaseException) -> EngineDeadError:
    """EngineDeadError with a message of ours; Ray's text (pids, addresses, actor ids) goes to
    the log only."""
    log.warning("%s: %s", message, cause)
    return EngineDeadError(message)


def _failed(error: BaseException) -> Exception:
    """The exception a failed actor call raises here: the engine's own EngineDeadError or
    ValueError (its message is the engine's), anything else by its type only."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, (EngineDeadError, ValueError)):
        return (EngineDeadError if isinstance(cause, EngineDeadError) else ValueError)(str(cause))
    log.error("the engine actor failed a call", exc_info=error)
    return RuntimeError(f"the engine failed the call ({type(cause or error).__name__})")

"""The control side of a replicated deployment's client: info, stats, health, scaling and the
operator's abort, each one call to the router actor with a deadline, and the router's errors
turned into messages of ours (Ray's text, which names pids, addresses and actor ids, goes to
the log only)."""
from __future__ import annotations

import asyncio
import logging

import ray

from tierserve.runtime.errors import EngineDeadError

__all__ = ["RouterControl"]

# The router client's logger: these are its calls.
log = logging.getLogger("tierserve.router_client")

# A call to the router waits this long at most (it answers, or asks every replica within 30 s).
_CALL_TIMEOUT_S = 60.0


class RouterControl:
    """The router's control calls, for a client holding the router's handle in `router`."""

    router: object

    def abort_now(self, names: list[str]) -> list[str]:
        """The operator's abort, on every replica: requests named by engine id or label."""
        refs = [a.abort_named.remote(list(names)) for a in self._actors()]
        found = []
        for got in ray.get(refs, timeout=60):
            found += got
        return list(dict.fromkeys(found))

    def _actors(self) -> list:
        return [actor for _, actor in _get(self.router.replica_actors.remote()).values()]

    def list_requests(self) -> list[dict]:
        return _get(self.router.list_requests.remote())

    def stats(self) -> dict:
        return _get(self.router.stats.remote())

    async def stats_async(self) -> dict:
        return await _get_async(self.router.stats.remote())

    def info(self) -> dict:
        return _get(self.router.info.remote())

    def health(self) -> bool:
        return _get(self.router.health.remote())

    async def health_async(self) -> bool:
        return await _get_async(self.router.health.remote())

    def reset_prefix_cache(self) -> bool:
        return _get(self.router.reset_prefix_cache.remote())

    def scale(self, size: int) -> dict:
        return _get(self.router.scale.remote(size))

    def describe(self) -> dict:
        return _get(self.router.describe.remote())


def _get(ref):
    try:
        return ray.get(ref, timeout=_CALL_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError as e:
        raise EngineDeadError(f"the router did not answer in {_CALL_TIMEOUT_S:.0f} s") from e
    except ray.exceptions.RayError as e:
        raise _router_error(e) from e


async def _get_async(ref):
    """_get without a thread, for an event loop (its caller may set a shorter deadline)."""
    try:
        return await asyncio.wait_for(asyncio.wrap_future(ref.future()), _CALL_TIMEOUT_S)
    except ray.exceptions.RayError as e:
        raise _router_error(e) from e


def _router_error(e: BaseException) -> Exception:
    """The router's own exception (EngineDeadError, ValueError: messages of ours), or one
    saying it is gone; Ray's text (pids, addresses, actor ids) goes to the log only."""
    if isinstance(e, ray.exceptions.RayActorError):
        log.warning("the router is gone: %s", e)
        return EngineDeadError("the router is gone")
    cause = getattr(e, "cause", None)
    if isinstance(cause, (EngineDeadError, ValueError)):
        return (EngineDeadError if isinstance(cause, EngineDeadError) else ValueError)(str(cause))
    log.error("the router failed a call", exc_info=e)
    return RuntimeError(f"the router failed the call ({type(cause or e).__name__})")

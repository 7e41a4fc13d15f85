"""Ray plumbing: starting Ray, an actor pool of NoteBankWorkers, and a bounded, fault-tolerant
dispatch loop (least-loaded actor first, at most `max_in_flight` calls per actor)."""
from __future__ import annotations

import dataclasses
import logging
import os
from contextlib import contextmanager
from typing import Callable, Iterable

import ray

from notebank.pipeline.config import ActorSpec, ModelSpec, RaySpec
from notebank.pipeline.worker import NoteBankWorker

log = logging.getLogger(__name__)


def init_ray(spec: RaySpec | None = None) -> bool:
    """Connect to `spec.address`, else $RAY_ADDRESS (set by `ray job submit`), else start a new local
    Ray. Returns True if this call started/connected Ray (the caller then shuts it down)."""
    if ray.is_initialized():
        return False
    spec = spec or RaySpec()
    address = spec.address or os.environ.get("RAY_ADDRESS") or "local"
    kwargs = {"namespace": spec.namespace, "log_to_driver": True}
    if address == "local":
        kwargs.update(include_dashboard=False, num_cpus=spec.num_cpus)
    ray.init(address=address, **kwargs)
    return True


def start_workers(model: ModelSpec, actors: ActorSpec) -> tuple[list, list[dict]]:
    opts = dict(num_cpus=actors.num_cpus, num_gpus=actors.num_gpus, max_restarts=actors.max_restarts,
                max_task_retries=actors.max_task_retries)
    if actors.accelerator_type:
        opts["accelerator_type"] = actors.accelerator_type
    threads = actors.torch_threads or max(1, int(actors.num_cpus))
    cls = ray.remote(NoteBankWorker)
    handles = [cls.options(**opts).remote(dataclasses.asdict(model), threads) for _ in range(actors.num_actors)]
    try:
        infos = ray.get([h.info.remote() for h in handles], timeout=actors.start_timeout_s)
    except ray.exceptions.GetTimeoutError as e:
        stop_workers(handles)
        raise RuntimeError(
            f"{actors.num_actors} actors ({opts}) did not start within {actors.start_timeout_s:.0f} s: the cluster "
            f"lacks the resources (available: {ray.available_resources()}) or loading the model hangs") from e
    except ray.exceptions.RayActorError as e:
        stop_workers(handles)
        raise RuntimeError(f"could not start the backbone actors (model {model}): {e}") from e
    fps = {(i["fingerprint"], i["tokenizer"]) for i in infos}
    if len(fps) != 1:
        stop_workers(handles)
        raise RuntimeError(f"actors loaded different models or tokenizers ({sorted(fps, key=str)}); is the checkpoint "
                           f"identical on every node?")
    return handles, infos


def stop_workers(handles: list) -> None:
    for h in handles:
        try:
            ray.kill(h, no_restart=True)
        except Exception:  # already gone
            pass


@contextmanager
def worker_pool(workers: tuple | None, start: Callable[..., tuple], *args):
    """-> (handles, infos): the caller's pool `workers` (reused, e.g. by benchmarks), else
    start(*args)'s, which is stopped on exit."""
    handles, infos = workers if workers is not None else start(*args)
    try:
        yield handles, infos
    finally:
        if workers is None:
            stop_workers(handles)


def worker_failure(err: Exception) -> str:
    """The error recorded for items whose actor call failed (message cut to 500 characters)."""
    return f"worker failed: {type(err).__name__}: {str(err)[:500]}"


def dispatch(handles: list, items: Iterable, submit: Callable, on_done: Callable, max_in_flight: int = 2,
             resubmit_on_actor_death: int = 1) -> None:
    """Run `submit(actor, item) -> ObjectRef` over `items` with bounded concurrency; call
    `on_done(item, result, error)` in completion order. Items are pulled lazily from the iterator.

    Ray already restarts dead actors and retries their calls (max_restarts / max_task_retries); if a
    call still fails because its actor is gone, the item is resubmitted to another live actor up to
    `resubmit_on_actor_death` times, then reported as failed."""
    n = len(handles)
    load = [0] * n
    alive = set(range(n))
    in_flight: dict = {}

    def _submit(item, attempt):
        if not alive:
            raise RuntimeError("all actors are dead")
        i = min(alive, key=lambda j: (load[j], j))
        ref = submit(handles[i], item)
        in_flight[ref] = (item, i, attempt)
        load[i] += 1

    def _drain(block: bool):
        ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=None if block else 0)
        for ref in ready:
            item, i, attempt = in_flight.pop(ref)
            load[i] -= 1
            try:
                res = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                if not _is_alive(handles[i]):
                    alive.discard(i)
                    log.warning("actor %d is gone: %s", i, e)
                if attempt < resubmit_on_actor_death and alive:
                    _submit(item, attempt + 1)
                else:
                    on_done(item, None, e)
                continue
            except ray.exceptions.RayError as e:
                on_done(item, None, e)
                continue
            on_done(item, res, None)

    for item in items:
        while in_flight and len(in_flight) >= max_in_flight * max(1, len(alive)):
            _drain(block=True)
        _submit(item, 0)
        if in_flight:
            _drain(block=False)
    while in_flight:
        _drain(block=True)


def _is_alive(h) -> bool:
    try:
        ray.get(h.info.remote(), timeout=120)
        return True
    except Exception:
        return False

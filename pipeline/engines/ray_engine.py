"""The Ray Data engine: planned work items on N stateful workers, outcomes streamed to the driver.

One document per block and one block at a time per worker, so a worker that dies
costs one document: Ray restarts the worker (always) and retries the document on it
at most ``engine.max_retries`` times; a document whose worker died on every try is
returned as failed by the driver, and the run goes on. Workers load the model once,
lazily, in their first call (``execute.Executor``), and never touch the store: the
driver persists each outcome as it arrives, under the run lock, so a killed driver
leaves a store the next run resumes. Each worker runs one document at a time, so
``velox_cache.observe``, which patches a module-level function for its whole process,
cannot interleave.

Without ``engine.address`` (or ``$RAY_ADDRESS``) a quiet local Ray is started with a
CPU per worker (``address="local"``: never a cluster some earlier ``ray start`` left
running); with one, the driver joins that cluster and workers get the driver's BLAS
preload and thread settings through Ray's runtime environment. A Ray session this
process already had (a notebook, a test) is used as it is and left running.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import warnings
from typing import Callable, Iterable, Iterator, Optional

import ray
import ray.data

from velox_cache.kernels.attend import ENVIRONMENT_VARIABLE as ATTENTION_VARIABLE
from velox_cache.kernels.attend import STREAMS_VARIABLE as ATTENTION_STREAMS_VARIABLE

from .. import model_store
from ..execute import Executor, VariantOutcome, failed_outcomes
from ..plan import WorkItem
from ..platform import BLAS_THREAD_VARIABLES
from ..spec import EngineSpec, JobSpec
from . import BadModel, EngineUnavailable

LOCAL = "local"
LOCAL_OBJECT_STORE_BYTES = 256 * 2**20

# Ray Data's notices about DataContext fields it sets itself say nothing a user can act on
warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"ray\.data\.context")


class _Worker:
    """Ray Data's callable class: a group of work items in (they decode together), their outcomes out (pickled)."""

    def __init__(self, executor: Executor):
        self.executor = executor

    def __call__(self, batch: dict) -> dict:
        items: list[WorkItem] = [pickle.loads(blob) for blob in batch["item"]]
        try:
            outcomes = self.executor.run_group(items)
        except Exception as exc:  # a bug, not a document error: still these documents, not a lost block
            outcomes = [failed_outcomes(item, f"{type(exc).__name__}: {exc}") for item in items]
        return {"index": [item.index for item in items], "outcomes": [pickle.dumps(o) for o in outcomes]}


def worker_env(cpus_per_worker: int) -> dict[str, str]:
    """Environment for workers on other machines: BLAS threads, and this driver's BLAS preload
    and attention settings (``VELOX_ATTENTION`` changes outputs; workers must match the driver)."""
    env = {name: str(cpus_per_worker) for name in BLAS_THREAD_VARIABLES}
    for name in ("LD_PRELOAD", ATTENTION_VARIABLE, ATTENTION_STREAMS_VARIABLE):
        if os.environ.get(name):
            env[name] = os.environ[name]
    return env


def connect(settings: EngineSpec) -> tuple[str, bool]:
    """Make sure this process is connected to Ray; returns ``(address, whether Ray was started here)``.

    A session this process already has is used as it is. Otherwise ``settings.address``,
    else ``$RAY_ADDRESS``, names a cluster to join; without either a local Ray is
    started with ``workers × cpus_per_worker`` CPUs (every CPU here by default).
    """
    if ray.is_initialized():
        return ray.get_runtime_context().gcs_address, False
    address = settings.address or os.environ.get("RAY_ADDRESS") or LOCAL
    options = {"address": address, "log_to_driver": False, "logging_level": "ERROR"}
    if address == LOCAL:
        # local workers inherit this process's environment (the CLI's BLAS preload)
        workers = settings.workers or os.cpu_count() or 1
        options.update(
            num_cpus=workers * settings.cpus_per_worker,
            include_dashboard=False,
            object_store_memory=LOCAL_OBJECT_STORE_BYTES,
        )
    else:
        options["runtime_env"] = {"env_vars": worker_env(settings.cpus_per_worker)}
        _check_reachable(address)
    previous_sigterm = signal.getsignal(signal.SIGTERM)
    try:
        ray.init(**options)
    except ConnectionError as exc:
        ray.shutdown()
        raise EngineUnavailable(f"engine.address: cannot join Ray at '{address}': {exc}") from None
    if previous_sigterm is not None:  # ray.init installs its own; the runner's marks the run interrupted
        signal.signal(signal.SIGTERM, previous_sigterm)
    return address, True


def _check_reachable(address: str, timeout: float = 10.0) -> None:
    """Fail fast when nothing listens at a ``host:port`` address (``ray.init`` retries for minutes)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return  # "auto" and other forms: Ray reports those itself
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as exc:
        raise EngineUnavailable(
            f"engine.address: nothing answers at {address} ({exc.strerror or exc}); "
            "start the cluster there with `ray start --head`, or leave the address out to run Ray here"
        ) from None


class RayEngine:
    """``engine.name: ray``; see the module docstring."""

    name = "ray"

    def __init__(self, settings: EngineSpec, *, load_model: Callable = model_store.load_model):
        self.settings = settings
        self.load_model = load_model
        self.workers: Optional[int] = settings.workers
        self.address: Optional[str] = None
        self._started_here = False
        self._executor: Optional[Executor] = None

    def start(self, spec: JobSpec) -> tuple[object, Optional[int]]:
        try:  # the driver only tokenizes; workers load the weights
            tokenizer, context = model_store.load_tokenizer(spec.model)
        except (model_store.ModelImportError, ValueError, OSError) as exc:
            raise BadModel(str(exc)) from None
        self._connect()
        self._executor = Executor(
            spec.model,
            model_store.weights_mode(),
            blas_threads=self.settings.cpus_per_worker,
            load_model=self.load_model,
        )
        return tokenizer, context

    def _connect(self) -> None:
        self.address, self._started_here = connect(self.settings)
        if self.workers is None:
            self.workers = max(1, int(ray.cluster_resources().get("CPU", 1)) // self.settings.cpus_per_worker)

    def run(self, items: Iterable[WorkItem]) -> Iterator[tuple[WorkItem, list[VariantOutcome]]]:
        """Each worker decodes groups of ``generation.decode_batch_size`` documents together.

        A worker that dies on a group (after its retries) takes the whole group, so
        the documents of groups that never came back are dispatched again one by one:
        only the document that kills its worker alone fails.
        """
        items = longest_first(items)  # the whole plan is made (and its settled rows stored) before dispatch
        if not items:
            return
        context = ray.data.DataContext.get_current()
        context.max_errored_blocks = -1  # a document whose worker keeps dying is dropped here, failed below
        context.execution_no_progress_timeout_s = -1  # one long document must not time the run out
        context.enable_progress_bars = False  # the runner reports progress
        context.execution_options.preserve_order = False
        _quiet_ray_data_console()
        group = items[0].generation.decode_batch_size
        pending = {item.index: item for item in items}
        yield from self._dispatch(items, group, pending)
        if group > 1 and len(pending) > 1:
            yield from self._dispatch(list(pending.values()), 1, pending)
        tries = self.settings.max_retries + 1
        for item in pending.values():
            message = f"worker died on each of {tries} tries of this document (engine.max_retries={tries - 1})"
            yield item, failed_outcomes(item, message)

    def _dispatch(self, items: list[WorkItem], group: int, pending: dict):
        """Run ``items`` in groups of ``group`` on the worker pool; what comes back leaves ``pending``."""
        blocks = -(-len(items) // group)
        dataset = ray.data.from_items([{"item": pickle.dumps(item)} for item in items], override_num_blocks=blocks)
        with warnings.catch_warnings():  # retries as remote arguments: deprecated, still the only way (Ray < 2.64)
            warnings.simplefilter("ignore", DeprecationWarning)
            dataset = dataset.map_batches(
                _Worker,
                fn_constructor_args=(self._executor,),
                batch_size=group,
                num_cpus=self.settings.cpus_per_worker,
                compute=ray.data.ActorPoolStrategy(size=min(self.workers, blocks), max_tasks_in_flight_per_actor=1),
                max_restarts=-1,  # always replace a dead worker (a finite number can hang the pool)
                max_task_retries=self.settings.max_retries,  # Ray Data's default retries forever
            )
        for row in dataset.iter_rows():
            item = pending.pop(int(row["index"]), None)
            if item is not None:
                yield item, pickle.loads(row["outcomes"])

    def close(self) -> None:
        if self._started_here and ray.is_initialized():
            ray.shutdown()
        self._started_here = False


def longest_first(items: Iterable[WorkItem]) -> list[WorkItem]:
    """The items in dispatch order: most prompt tokens to run first (ties keep input order).

    Workers take items in this order, so the run does not end with one worker on a
    long document while the others idle (longest-processing-time-first scheduling).
    """
    return sorted(items, key=lambda item: -len(item.prompt_tokens) * len(item.variants))


def _quiet_ray_data_console() -> None:
    """Ray Data's INFO lines stay in its session log file; only errors reach the console."""
    for handler in logging.getLogger("ray.data").handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            handler.setLevel(logging.ERROR)

"""Resume-matrix stack: the user drives DCP themselves, with spotckpt only as its storage.

One process; ``torch.distributed.checkpoint.save`` / ``async_save`` / ``load`` with
``spotckpt.dcp_writer`` / ``spotckpt.dcp_reader`` (docs/dcp.md) and a
`PreemptionWatcher` of its own. Without `TrainState`, the state dict is the user's: model and
optimizer through DCP's ``get_state_dict`` family, the scheduler, the loader's position (a
`StatefulDataLoader` or a `ResumableSampler` is a DCP ``Stateful`` as it is), the RNGs, the step
and the extras. Nothing shields the loader's workers from a SIGTERM to the process group either,
so their ``worker_init_fn`` ignores it, as such a user must. Only the loader set-ups such a user
can resume exactly are listed: a `ResumableSampler` (its order is a function of seed and epoch),
with and without `SeededDataset`. torchdata's ``shuffle=True`` sampler shares the loader's
``generator=`` and resets it on load, so the epoch after a resume is shuffled differently
(``stateful`` here differs from step 7 on, the first step of epoch 1), and a torch
``RandomSampler`` or a loader without ``generator=`` loses its epoch-start state: what
`TrainState` adds (`spotckpt.loader_rng`) is not there for a raw DCP user.
"""

from __future__ import annotations

import random
import signal
import sys
from typing import Any

from _worker import serve

DESCRIBE = {
    "ranks": [1],
    "loaders": ["resumable", "resumable-augment"],
    "world_change": False,
    "steps": 20,
    "save_every": 4,
}


class AppState:
    """Model, optimizer and scheduler, as DCP's own tutorial wraps them."""

    def __init__(self, job: Any) -> None:
        self.job = job

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = get_state_dict(self.job.model, self.job.optimizer)
        return {"model": model, "optim": optimizer, "scheduler": self.job.scheduler.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.job.model,
            self.job.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )
        self.job.scheduler.load_state_dict(state_dict["scheduler"])


class RNGs:
    """Python's, NumPy's and torch's RNG states, as tensors and plain values."""

    def state_dict(self) -> dict[str, Any]:
        import numpy as np
        import torch

        version, state, gauss = random.getstate()
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        return {
            "python": {"version": version, "state": torch.tensor(state), "gauss": gauss},
            "numpy": {
                "name": name,
                "keys": torch.from_numpy(np.asarray(keys).astype(np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "gauss": float(cached),
            },
            "torch": torch.get_rng_state(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        import numpy as np
        import torch

        python = state_dict["python"]
        state = tuple(int(v) for v in python["state"].tolist())
        random.setstate((python["version"], state, python["gauss"]))
        numpy = state_dict["numpy"]
        np.random.set_state(
            (
                numpy["name"],
                numpy["keys"].numpy().astype(np.uint32),
                numpy["pos"],
                numpy["has_gauss"],
                numpy["gauss"],
            )
        )
        torch.set_rng_state(state_dict["torch"])


class Progress:
    """The step and the extras (updated in place)."""

    def __init__(self, extra: dict[str, Any]) -> None:
        self.step = 0
        self.extra = extra

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "extra": dict(self.extra)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.extra.update(state_dict["extra"])


def ignore_sigterm(worker_id: int) -> None:
    """Loader workers outlive a SIGTERM to the process group; the trainer shuts them down."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class RawCheckpoints:
    """Periodic saves, an emergency save on a preemption notice, and the latest-step restore."""

    def __init__(self, job: Any) -> None:
        import spotckpt

        self.case = job.case
        self.progress = Progress(job.extra)
        self.app = {
            "app": AppState(job),
            "rng": RNGs(),
            "loader": job.data.stateful(),
            "progress": self.progress,
        }
        self.watcher = spotckpt.PreemptionWatcher(aws=False, gce=False).start()
        self.pending: Any = None
        self.pending_step: int | None = None
        self.latest: int | None = None
        self.stop = False

    def restore(self) -> int | None:
        import torch.distributed.checkpoint as dcp

        import spotckpt

        try:
            reader = spotckpt.dcp_reader(self.case.uri)
        except spotckpt.NoCheckpointError:
            return None
        dcp.load(self.app, storage_reader=reader, no_dist=True)
        self.latest = self.progress.step
        return self.latest

    def save(self, step: int, blocking: bool) -> None:
        import torch.distributed.checkpoint as dcp

        import spotckpt

        self.wait()
        self.progress.step = step
        writer = spotckpt.dcp_writer(self.case.uri, step)
        if blocking or not self.case.async_save:
            dcp.save(self.app, storage_writer=writer, no_dist=True)
            self.latest = step
        else:
            self.pending = dcp.async_save(self.app, storage_writer=writer, no_dist=True)
            self.pending_step = step

    def wait(self) -> None:
        """Let an asynchronous save commit (raising its error)."""
        if self.pending is None:
            return
        getattr(self.pending, "upload_completion", self.pending).result()
        self.latest, self.pending, self.pending_step = self.pending_step, None, None

    def maybe_save(self, step: int) -> bool:
        if (
            self.pending is not None
            and getattr(self.pending, "upload_completion", self.pending).done()
        ):
            self.wait()
        if self.watcher.preempted:
            self.wait()  # the upload in flight first
            if self.latest != step:
                self.save(step, blocking=True)
            self.stop = True
            return True
        if step % self.case.save_every == 0:
            self.save(step, blocking=False)
            return True
        return False

    def preempted(self) -> bool:
        return self.watcher.preempted

    def should_stop(self) -> bool:
        return self.stop

    def finish(self, step: int) -> bool:
        self.wait()
        if self.latest == step:
            return False
        self.save(step, blocking=True)
        return True

    def close(self) -> None:
        self.wait()
        self.watcher.stop()


def run(case: dict[str, Any]) -> int:
    import _common

    job = _common.make_job(_common.Case.from_json(case), None, distributed=False)
    if job.data.loader.num_workers > 0:
        job.data.loader.worker_init_fn = ignore_sigterm
    return _common.run(job, RawCheckpoints(job))


if __name__ == "__main__":
    sys.exit(serve(DESCRIBE, run))

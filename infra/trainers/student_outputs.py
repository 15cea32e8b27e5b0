"""What a rank makes of the student besides training: its evaluation and its export. Rank 0 works, every rank
takes part (a sharded model gathers there, and a family that splits its evaluation samples on every rank).

`StudentOutputs` is a part of `infra.trainers.rank.RankWorker`, kept apart to keep each file one concern: it uses
the worker's store, family, run spec, rank, device, models, `_objects` (its group of object collectives) and
`colocated` (the workers of its process).
"""

import logging
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from dmd2.failures import NonFiniteError
from dmd2.family import Evaluation
from dmd2.model import HostCalls
from dmd2.tensors import non_finite
from infra.store import ArtifactRef, StoreError
from infra.trainers.collective import gathered, on_every_rank, on_rank0
from infra.trainers.parallel import borrows_teacher, full_state_dict, unsharded_copy
from infra.trainers.sequence import data_rank, sequence_rank

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalResult:
    """Rank 0's evaluation of the student: its scores, its media in the store, and (when asked) the
    family's baseline rows scored the same way."""

    scores: dict[str, float]
    media: ArtifactRef | None
    baselines: list[tuple[str, dict[str, float]]] | None = None


@contextmanager
def _sampling(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode (sampled as users sample it), back in train mode after."""
    model.eval()
    try:
        yield
    finally:
        model.train()


def _pictures(media: dict[str, np.ndarray]) -> dict[str, Tensor]:
    """An evaluator's uint8 pictures as tensors the store can hold."""
    return {name: torch.from_numpy(np.ascontiguousarray(picture)) for name, picture in media.items()}


class StudentOutputs:
    """Evaluation and export of the student, as methods of `RankWorker` (see the module docstring); its state is
    the worker's ``_evaluator`` (built on first use), ``_references_key`` and ``_references_kept``."""

    def evaluate(self, run_id: str, step: int, with_baselines: bool = False) -> EvalResult:
        """The family's evaluation of the current student; media go to ``<run_id>/eval/<step>/media``. A family
        that splits its evaluation (`ModelFamily.splits_evaluation`) samples on every rank, a share each, with
        the model as the rank holds it (nothing gathered); else rank 0 samples with a whole copy. Rank 0 scores."""
        with self._in_use(), self._student_weights():
            if self.family.splits_evaluation:
                evaluator = on_every_rank(lambda: self._get_evaluator(run_id), self._objects)
                self._share_references(evaluator)
                velocity = HostCalls(self._velocity(self.module), self.device)
                with _sampling(self.module):
                    shares = gathered(self._student_share(evaluator, velocity), self._objects)
                return on_rank0(lambda: self._result(evaluator.score(torch.cat(shares)), run_id, step,
                                                     with_baselines), self._objects)
            with self._unsharded() as student:
                def work() -> EvalResult:
                    with _sampling(student):
                        evaluation = self._get_evaluator(run_id).evaluate(
                            HostCalls(self._velocity(student), self.device))
                    return self._result(evaluation, run_id, step, with_baselines)
                return on_rank0(work, self._objects)

    def _student_share(self, evaluator, velocity):
        """This rank's share of a split evaluation's student samples (`_data_share`)."""
        return self._data_share(lambda rank, ranks: evaluator.student_share(velocity, rank, ranks))

    def _data_share(self, sample):
        """``sample(data rank, data ranks)``, for this rank's share of a split evaluation: under `[train]
        sequence_parallel` a sequence group samples one share together (its models' forwards are its collectives);
        its first rank keeps it (the samples, a tensor or a dict of them), the others none."""
        train = self.spec.config.train

        def share():
            samples = sample(data_rank(self.rank, train), train.data_ranks)
            if sequence_rank(self.rank, train) == 0:
                return samples
            return samples[:0] if isinstance(samples, Tensor) else {name: t[:0] for name, t in samples.items()}
        return share

    def _result(self, evaluation: Evaluation, run_id: str, step: int, with_baselines: bool) -> EvalResult:
        """Rank 0's part after sampling: the baselines, the references kept, the media stored."""
        baselines = self._evaluator.baselines() if with_baselines else None
        self._keep_references()
        media = _pictures(evaluation.media)
        media_ref = self.store.put_tensors(f"{run_id}/eval/{step}/media.safetensors", media) if media else None
        return EvalResult(evaluation.scores, media_ref, baselines)

    def reference_media(self, run_id: str) -> ArtifactRef | None:
        """The evaluator's pictures to show once beside the student's (e.g. the teacher's grid) -> the store."""
        if self.family.splits_evaluation:  # a rank failing to build its evaluator fails them all, none waits
            self._share_references(on_every_rank(lambda: self._get_evaluator(run_id), self._objects))

        def work() -> ArtifactRef | None:
            media = self._get_evaluator(run_id).reference_media()
            self._keep_references()
            if not media:
                return None
            return self.store.put_tensors(f"{run_id}/eval/reference/media.safetensors", _pictures(media))
        return on_rank0(work, self._objects)

    def _share_references(self, evaluator) -> None:
        """The teacher's samples of a split evaluation made by every rank, a share each (`_data_share`), for rank 0's
        evaluator, unless it has them (made or stored earlier in the run). Collective."""
        if on_rank0(evaluator.has_references, self._objects):
            return
        shares = gathered(self._data_share(evaluator.teacher_share), self._objects)
        if self.rank == 0:
            evaluator.with_references({name: torch.cat([share[name] for share in shares]) for name in shares[0]})

    def _get_evaluator(self, run_id: str):
        """The run's evaluator, built on first use (reference statistics are not cheap) for this rank's device,
        with what an earlier rank process of the run stored of its references (`_keep_references`)."""
        if self._evaluator is None:
            evaluator = self.family.evaluator(self.spec.config, Path(self.spec.cache_dir), self.device)
            if (lender := self._teacher_lender()) is not None:
                evaluator.lent_teacher = lender.lend_teacher
            self._references_key = f"{run_id}/eval/reference/{evaluator.references_id()}"
            # Rank 0 alone scores, so it alone reads them (the other ranks' shares are asked only without them).
            if self.rank == 0 and (ref := self.store.find_json(f"{self._references_key}.json")) is not None:
                try:
                    evaluator.with_references(self.store.get_tensors(ArtifactRef.from_dict(ref)))
                    self._references_kept = True
                except (StoreError, FileNotFoundError, ValueError) as exc:  # made again rather than trusted
                    logger.warning("making the evaluation references again: %s unreadable (%s)",
                                   self._references_key, exc)
            self._evaluator = evaluator
        return self._evaluator

    def _teacher_lender(self):
        """The critic's worker in this process, whose teacher a split evaluation borrows for its reference samples
        rather than load a second copy on the same GPU (`borrows_teacher`); None when there is none to borrow."""
        critic = self.colocated.get("critic")
        if not (self.family.splits_evaluation and borrows_teacher(self.spec.config)) or critic is None:
            return None
        return critic if critic.teacher is not None else None

    def _keep_references(self) -> None:
        """Store the evaluator's once-per-run references (rank 0, once), for the rank processes that may replace
        this one in the run (recovery, resume)."""
        if not self._references_kept and (tensors := self._evaluator.references()):
            ref = self.store.put_tensors(f"{self._references_key}.safetensors", tensors)
            self.store.put_json(f"{self._references_key}.json", ref.to_dict())
        self._references_kept = True

    def export(self, run_id: str, step: int, card: dict[str, Any]) -> ArtifactRef:
        """The family's export of the student (e.g. a diffusers directory) -> ``<run_id>/student/<step>``."""
        with self._in_use(), self._student_weights(), self._unsharded(on_device=False) as student:
            def work() -> ArtifactRef:
                if problem := non_finite(student.state_dict().items()):
                    raise NonFiniteError(f"the student of step {step} was not exported: {problem}")
                key = f"{run_id}/student/{step}"
                self.store.discard_dir(key)  # left by an export cut short (a run's result names its export)
                with tempfile.TemporaryDirectory() as tmp:
                    out = Path(tmp) / "student"
                    self.family.export(student, self.spec.config, out, card)
                    return self.store.put_dir(key, out)
            return on_rank0(work, self._objects)

    def export_weights(self, key: str, ema: bool = False) -> ArtifactRef:
        """Rank 0 stores the model's state dict at ``key`` (safetensors), with ``ema`` the EMA's weights in
        it; every rank returns the ref."""
        if ema and self.state.ema is None:
            raise ValueError(f"the {self.trainer.role} group keeps no EMA: set [student] ema_decay > 0")
        with self._in_use(), self._student_weights() if ema else nullcontext():
            state = full_state_dict(self.module)  # every rank takes part; rank 0 gets the tensors
            return on_rank0(lambda: self.store.put_tensors(key, {k: v.detach().cpu().contiguous()
                                                                 for k, v in state.items()}), self._objects)

    def _student_weights(self):
        """The weights evaluation and export use: inside the block the EMA's (`[student] ema_decay` > 0),
        else the raw ones. Each rank swaps its own part in place: no collective, nothing gathered."""
        return self.state.ema.applied() if self.state.ema is not None else nullcontext()

    @contextmanager
    def _unsharded(self, on_device: bool = True):
        """Rank 0's whole student (None on other ranks): the module itself under DDP; under FSDP a copy gathered
        from every rank's shards (a collective: every rank enters), on rank 0's device, or ``on_device=False`` in
        its host memory (export writes files: a whole copy on the GPU beside its shards would only risk a run's
        last step running out of memory)."""
        if not self.sharded:
            yield self.module if self.rank == 0 else None
            return
        state = full_state_dict(self.module)
        copy = unsharded_copy(self.module, state) if self.rank == 0 else None
        yield copy.to(self.device) if copy is not None and on_device else copy

"""The Ray worker of every Megatron role (actor, critic, ref, reward model): a thin shell over workers/*.

One process of the role's SPMD world. The controller builds the group (megarl/cluster), then calls `setup` once
with the role's settings; after that every call takes this rank's share of a batch (dp_split) and the results
come back from the data-parallel leaders (TP rank 0 on the last pipeline stage). No algorithm math here: loss
functions arrive from the controller.
"""

from __future__ import annotations

import time
from typing import Any

from megarl.cluster.worker import ParallelInfo, Worker
from megarl.data.batch import Batch
from megarl.runtime import faults
from megarl.workers.config import MicroBatchSettings, ModelSettings, OptimizerSettings


class MegatronWorker(Worker):
    def setup(
        self,
        model: ModelSettings,
        micro_batch: MicroBatchSettings,
        head: str = "lm",
        optimizer: OptimizerSettings | None = None,
        total_steps: int = 1,
        seed: int = 1,
        path: str | None = None,
    ) -> dict[str, Any]:
        """Initialize Megatron's parallel state at the role's layout and load the model (trainable when optimizer
        settings are given). `path` overrides model.path (resuming from a run checkpoint)."""
        from megarl.runtime.distributed import init_model_parallel
        from megarl.workers.role_model import build_role_model

        start = time.perf_counter()
        init_model_parallel(model.parallel, seed=seed)
        self.micro_batch = micro_batch
        self.model = build_role_model(model, head, optimizer, total_steps, path)
        num_params = sum(p.numel() for chunk in self.model.loaded.chunks for p in chunk.parameters())
        return {"seconds": time.perf_counter() - start, "local_params": num_params}

    @property
    def device(self):
        """The GPU Ray gave this worker (its current CUDA device), or the CPU."""
        from megarl.runtime.device import local_device

        return local_device()

    def parallel_info(self) -> ParallelInfo:
        from megatron.core import parallel_state as ps

        from megarl.workers.schedule import is_output_rank

        return ParallelInfo(ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), is_output_rank())

    def set_optimizer(self, optimizer: OptimizerSettings, total_steps: int) -> None:
        """A fresh optimizer (a new stage, e.g. RL after SFT, starts its own schedule and Adam state)."""
        from megarl.workers.optimizer import build_optimizer

        self.model.optimizer = build_optimizer(optimizer, self.model.chunks, total_steps)

    def _packing(self, batch: Batch) -> bool:
        """micro_batch.packing, for a batch where it pays (micro_batch.packing_min_padding)."""
        from megarl.workers.schedule import packing_pays, shares_prompts

        if not self.micro_batch.packing:
            return False
        return packing_pays(batch, self.micro_batch.packing_min_padding, shares_prompts(self.model.chunks))

    # -- policy (actor, ref) -------------------------------------------------------------------------------------

    def compute_logprobs(
        self,
        batch: Batch,
        temperature: float = 1.0,
        with_entropy: bool = False,
        routing: str = "off",
        with_sum_pi_squared: bool = False,
    ) -> Batch | None:
        """Log-probs; MoE models: `routing` says what the routers do (observe, replay, record: policy.py)."""
        from megarl.workers.policy import compute_logprobs

        budget, chunk_tokens = self.micro_batch.forward_budget, self.micro_batch.logprob_chunk_tokens
        packing = self._packing(batch)
        return compute_logprobs(
            self.model, batch, temperature, budget, with_entropy, routing, packing, with_sum_pi_squared, chunk_tokens
        )

    def update_policy(self, batch: Batch, loss_fn, temperature: float = 1.0) -> dict[str, float]:
        from megarl.workers.policy import update_policy

        faults.hit(f"{self.role}.update")
        settings = self.micro_batch
        return update_policy(
            self.model,
            batch,
            loss_fn,
            temperature,
            settings.max_tokens,
            self._packing(batch),
            settings.logprob_chunk_tokens,
        )

    # -- value (critic, reward model) ----------------------------------------------------------------------------

    def compute_values(self, batch: Batch) -> Batch | None:
        from megarl.workers.value import compute_values

        return compute_values(self.model, batch, self.micro_batch.forward_budget, self._packing(batch))

    def update_critic(self, batch: Batch, loss_fn) -> dict[str, float]:
        from megarl.workers.value import update_critic

        return update_critic(self.model, batch, loss_fn, self.micro_batch.max_tokens, self._packing(batch))

    def compute_scores(self, batch: Batch) -> Batch | None:
        from megarl.workers.value import compute_scores

        return compute_scores(self.model, batch, self.micro_batch.forward_budget, self._packing(batch))

    def update_reward_model(self, batch: Batch) -> dict[str, float]:
        from megarl.workers.value import update_reward_model

        return update_reward_model(self.model, batch, self.micro_batch.max_tokens, self._packing(batch))

    def greedy_decode(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int]) -> list[list[int]]:
        """Reference greedy decoding with the Megatron model (checks of the rollout engine)."""
        from megarl.workers.reference_decode import greedy_decode

        return greedy_decode(self.model, prompts, max_new_tokens, frozenset(stop_ids))

    # -- weights ---------------------------------------------------------------------------------------------------

    def sync_weights(self, route, version: int, bucket_bytes: int, keep_samples: bool = True) -> dict:
        """Stream this rank's share of the HF-named weights into every rollout engine along `route` (a SyncRoute:
        workers/weight_sync.py), keeping what a transport needs between syncs (the NCCL group). `keep_samples`:
        return the norm weights sent, for the controller to verify the engines against."""
        from megarl.workers.weight_sync import SenderState, send_weights

        faults.hit(f"{self.role}.sync")
        if getattr(self, "_sender_state", None) is None:
            self._sender_state = SenderState()
        return send_weights(self.model.loaded, route, version, bucket_bytes, self._sender_state, keep_samples)

    def export_weights(self) -> list[tuple[str, object]]:
        """This rank's share of the HF-named weights, as a sync would send them (checks and debugging; a sync
        streams them instead of holding them all)."""
        from megarl.bridge.exporter import export_hf_weights

        loaded = self.model.loaded
        return [
            (name, tensor.clone())
            for bucket in export_hf_weights(loaded.bridge, loaded.hf_dtypes)
            for name, tensor in bucket
        ]

    def save_checkpoint(self, folder: str) -> None:
        """Collective: model weights (a megarl checkpoint folder), optimizer state and RNG into `folder`."""
        from megarl.workers.role_checkpoint import save_role

        save_role(self.model, folder)

    def load_checkpoint(self, folder: str, load_optimizer: bool = True, load_weights: bool = True) -> None:
        from megarl.workers.role_checkpoint import load_role

        load_role(self.model, folder, load_optimizer, load_weights)

    def offload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        self.model.offload(params, grads, optimizer)

    def onload(self) -> None:
        self.model.onload()

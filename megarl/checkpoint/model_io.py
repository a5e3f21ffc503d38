"""Build a rank's Megatron-Core model from a HF folder or a megarl checkpoint, and save it as a megarl checkpoint.

Both are collective over all ranks (Megatron's parallel state must be initialized with the wanted layout). A HF
folder is imported through the bridge (each rank reads the tensors its shards need); a megarl checkpoint is loaded
through Megatron's distributed checkpointing, at any layout.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.bridge.importer import load_hf_weights
from megarl.bridge.mappings import VocabInfo, pad_vocab_size
from megarl.bridge.model_bridge import ModelBridge
from megarl.bridge.safetensors_io import TensorSpec
from megarl.checkpoint.carried import CarriedFiles, carried_note
from megarl.checkpoint.dist_io import check_loadable, load_model_weights, save_model_weights
from megarl.checkpoint.model_dir import (
    HF_DIR,
    MODEL_DIR,
    ModelCheckpointInfo,
    is_megarl_checkpoint,
    load_manifest,
    save_manifest,
)
from megarl.checkpoint.staging import check_destination
from megarl.models.architecture import Architecture
from megarl.models.builder import build_bridge, build_model
from megarl.models.heads import VALUE_HEAD_HF_NAME, Head
from megarl.models.hf_config import config_dtype, dtype_name, load_hf_config, read_config_json, read_hf_weights
from megarl.models.layout import check_parallel_layout
from megarl.models.registry import get_architecture
from megarl.models.specs import SpecBackend
from megarl.runtime.parallel import ParallelConfig

log = logging.getLogger("megarl")


@dataclass
class LoadedModel:
    """A rank's model chunks together with everything needed to map them back to the HF checkpoint."""

    chunks: list[torch.nn.Module]
    bridge: ModelBridge
    arch: Architecture
    hf_config: object
    vocab: VocabInfo
    source: Path
    """What the model was loaded from: a HF folder or a megarl checkpoint folder. Only read while loading: a run
    checkpoint it names may be deleted by rotation while the model lives on."""
    origin: str
    """The HF folder the weights first came from (recorded in every checkpoint saved from this model)."""
    carried: CarriedFiles = field(default_factory=CarriedFiles)
    """What a save copies unchanged (HF side files, tensors Megatron does not hold), captured at load time."""
    hf_specs: list[TensorSpec] = field(default_factory=list)
    """The source HF checkpoint's tensors (name, dtype, shape): what an export must reproduce."""
    head: Head = "lm"
    """The output head: language model logits, or a scalar value head (critics, reward models)."""
    quantization: dict | None = None
    """The quantization_config of the FP8 checkpoint the weights first came from (they are held dequantized):
    the format rollout engines get by default (rollout.weights_format)."""

    @property
    def hf_dtypes(self) -> dict[str, torch.dtype]:
        default = config_dtype(self.hf_config)
        dtypes = {name: default for name in self.bridge.hf_names(exported_only=True)}
        dtypes.update({spec.name: spec.dtype for spec in self.hf_specs})
        return dtypes


def load_model(
    path: str | Path,
    parallel: ParallelConfig,
    dtype: torch.dtype = torch.float32,
    vocab_multiple: int = 128,
    head: Head = "lm",
    config_overrides: dict | None = None,
    spec_backend: SpecBackend = "auto",
) -> LoadedModel:
    """Build this rank's chunks and fill them from `path` (a HF folder or a megarl checkpoint folder).

    head: "value" builds a critic / reward model; from a HF language model (no `score.weight`) its value head
    starts fresh, and a megarl checkpoint must hold a value head already.
    """
    path = Path(path)
    build = dict(head=head, config_overrides=config_overrides, spec_backend=spec_backend)
    if is_megarl_checkpoint(path):
        info = ModelCheckpointInfo.load(path)
        check_loadable(info, parallel)
        model = _build(path, path / HF_DIR, parallel, dtype, lambda hf_config: info.vocab, **build)
        load_model_weights(model.chunks, path / MODEL_DIR)
        model.hf_specs = load_manifest(path) or []
        model.origin = info.source or str(path)
        model.carried = CarriedFiles.from_checkpoint(path)
        model.quantization = info.quantization
        return model
    read_config_json(path)

    def vocab_of(hf_config) -> VocabInfo:
        return VocabInfo(hf_config.vocab_size, pad_vocab_size(hf_config.vocab_size, vocab_multiple, parallel.tp))

    model = _build(path, path, parallel, dtype, vocab_of, **build)
    checkpoint = read_hf_weights(path)  # a vision-language checkpoint's language model under the text names
    load_hf_weights(model.bridge, checkpoint, missing_ok=(VALUE_HEAD_HF_NAME,) if head == "value" else ())
    arch, hf_config = model.arch, model.hf_config
    carried = [name for name in checkpoint.names if arch.is_carried(name, hf_config)]
    model.hf_specs = [s for s in checkpoint.specs() if s.name not in carried and not arch.is_derived(s.name)]
    model.carried = CarriedFiles.from_hf_folder(path, carried)
    if carried and (not dist.is_initialized() or dist.get_rank() == 0):
        log.info("%s: %s", path, carried_note(arch, hf_config, carried))
    model.quantization = checkpoint.quantization.config if checkpoint.quantization else None
    return model


def _build(
    source: Path,
    hf_dir: Path,
    parallel: ParallelConfig,
    dtype: torch.dtype,
    vocab_of,
    head: Head,
    config_overrides: dict | None,
    spec_backend: SpecBackend,
) -> LoadedModel:
    hf_config = load_hf_config(hf_dir)
    arch = get_architecture(hf_config.model_type)
    check_parallel_layout(arch, hf_config, parallel)
    vocab = vocab_of(hf_config)
    chunks = build_model(
        arch, hf_config, parallel, vocab, dtype, spec_backend=spec_backend, head=head, config_overrides=config_overrides
    )
    bridge = build_bridge(arch, hf_config, chunks, vocab, head)
    return LoadedModel(chunks, bridge, arch, hf_config, vocab, source, origin=str(source), head=head)


def save_model(
    model: LoadedModel,
    folder: str | Path,
    overwrite: bool = False,
    extra_writer: Callable[[Path], None] | None = None,
) -> Path:
    """Collective: write `model` as a megarl checkpoint folder, visible at `folder` only once complete.

    extra_writer(tmp): a collective that writes more state into the staging folder before it is renamed into
    place (a trained role's optimizer and RNG state: workers/role_checkpoint.py)."""
    rank = dist.get_rank()
    folder = Path(folder).resolve()
    tmp = folder.parent / f".{folder.name}.partial"
    if rank == 0:
        check_destination(folder, overwrite)
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / MODEL_DIR).mkdir(parents=True)
        model.carried.write(tmp)
        save_manifest(tmp, model.hf_specs)
        ModelCheckpointInfo(
            architecture=model.arch.name,
            vocab_size=model.vocab.size,
            padded_vocab_size=model.vocab.padded_size,
            params_dtype=dtype_name(model.chunks[0].config.params_dtype),
            layout=current_layout(model.chunks[0].config),
            source=model.origin,
            quantization=model.quantization,
        ).save(tmp)
    dist.barrier()
    save_model_weights(model.chunks, tmp / MODEL_DIR)
    if extra_writer is not None:
        extra_writer(tmp)
    dist.barrier()
    if rank == 0:
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    dist.barrier()
    return folder


def current_layout(config) -> dict[str, int]:
    """The layout of Megatron's parallel state now and of the model built with TransformerConfig `config` (its
    pipeline stages), as checkpoints record it."""
    from megatron.core import parallel_state as ps

    return ParallelConfig(
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        vpp=ps.get_virtual_pipeline_model_parallel_world_size() or 1,
        ep=ps.get_expert_model_parallel_world_size(),
        etp=ps.get_expert_tensor_parallel_world_size() if ps.get_expert_model_parallel_world_size() > 1 else None,
        pp_first_stage_layers=config.num_layers_in_first_pipeline_stage,
        pp_last_stage_layers=config.num_layers_in_last_pipeline_stage,
    ).layout_dict()

"""The DSpark drafter's weights (:class:`DrafterWeights`): the checkpoint's ``mtp.{s}.*`` tensors, read lazily in
their shipped formats with the target's own block loaders.

A draft stage is a DeepSeek-V4 block with sliding-window attention (compress ratio 0) and a learned gate, so the
drafter's stages are read as the layers of a small model, :func:`stage_config` (the target's dimensions, one SWA
layer per stage, no hash layer): a :class:`~dspark_kernels.model.weights.ModelWeights` over a view of the
checkpoint that names ``mtp.{s}.X`` as ``layers.{s}.X`` and the last stage's ``norm`` / ``hc_head_*`` as the
model-level ones. Everything the target's loader does (validation against the shipped formats, FP8 / FP4
dequantisation per tensor, routed experts one at a time when streaming) is then the drafter's too.

The drafter's own tensors (names in :mod:`dspark_kernels.model.checkpoint_format`, ``draft_formats``; T target
layers, r Markov rank, V vocabulary, D hidden):

=======================================  ==========  ==========================================================
name                                     shape       role
=======================================  ==========  ==========================================================
``mtp.0.main_proj.weight``               [D, T*D]    target features -> ``main_x`` (FP8 + 128x128 scales shipped)
``mtp.0.main_norm.weight``               [D]         RMSNorm of ``main_x``
``mtp.{S-1}.markov_head.markov_w1``      [V, r]      Markov embedding of the previous token
``mtp.{S-1}.markov_head.markov_w2``      [V, r]      Markov bias ``markov_w2 @ embedding`` over the vocabulary
``mtp.{S-1}.confidence_head.proj``       [1, D + r]  raw confidence logit (optional in a checkpoint: then None)
=======================================  ==========  ==========================================================

The embedding and the LM head are the target's (shared): they are never read from the drafter's view.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from dspark_abi import ABIError, Issue, ModelConfig
from dspark_kernels.model.block_weights import HcWeights
from dspark_kernels.model.checkpoint_format import DraftLayout, QuantFormat, TensorFormat, draft_formats
from dspark_kernels.model.shard_index import ShardIndex, StoredTensor
from dspark_kernels.model.weight_specs import TensorSpec, WeightsError, weight_specs
from dspark_kernels.model.weights import LayerWeights, ModelWeights, RandomSource

_STAGE = re.compile(r"^layers\.(\d+)\.")
_MTP = re.compile(r"^mtp\.(\d+)\.")
#: Model-level names of the stage view that are the last stage's own tensors.
_LAST_STAGE_GLOBALS = ("norm.weight", "hc_head_fn", "hc_head_scale", "hc_head_base")


def drafter_issues(config: ModelConfig) -> list[Issue]:
    """``drafter.config`` issues of a config that cannot run the DSpark drafter (empty = it can): no block size, no
    target layers, or a noise token outside the vocabulary (the Markov rank is always >= 1)."""
    out = []
    if not config.dspark_block_size:
        out.append(Issue("drafter.config", "dspark_block_size", "the config has no DSpark drafter (block size 0)",
                         expected=">= 1", actual=0, fix="use a DSpark config (e.g. the flash-dspark preset)"))
    if not config.dspark_target_layers:
        out.append(Issue("drafter.config", "dspark_target_layers", "the drafter needs target layers",
                         expected="e.g. [40, 41, 42]", actual=[], fix="set dspark_target_layer_ids"))
    if not 0 <= config.dspark_noise_token_id < config.vocab_size:
        out.append(Issue("drafter.config", "dspark_noise_token_id", "the noise token must be a vocabulary id",
                         expected=f"[0, {config.vocab_size})", actual=config.dspark_noise_token_id,
                         fix="copy dspark_noise_token_id from the checkpoint's config.json"))
    return out


def has_drafter(config: ModelConfig) -> bool:
    """Whether ``config`` describes a DSpark drafter (no :func:`drafter_issues`)."""
    return not drafter_issues(config)


def stage_config(config: ModelConfig) -> ModelConfig:
    """The drafter's stages as a model config: ``config``'s dimensions, ``n_mtp_layers`` SWA layers with learned
    gates (layer s = stage s), no drafter keys. Raises :class:`ABIError` (``drafter.config``) when ``config`` has
    no drafter."""
    issues = drafter_issues(config)
    if issues:
        raise ABIError(issues)
    return config.model_copy(update={
        "name": f"{config.name}-drafter", "compress_ratios": (0,) * config.n_mtp_layers,
        "moe": config.moe.model_copy(update={"num_hash_layers": 0}), "dspark_target_layers": (),
        "dspark_block_size": 0, "dspark_noise_token_id": 0})


def draft_layout(config: ModelConfig) -> DraftLayout:
    """The checkpoint's draft layers of a DSpark ``config``."""
    return DraftLayout("dspark", config.n_mtp_layers, config.dspark_markov_rank, config.dspark_target_layers)


def checkpoint_name(view_name: str, stages: int) -> str:
    """The checkpoint name of a stage-view name: ``layers.{s}.X`` -> ``mtp.{s}.X``; the last stage's ``norm`` and
    ``hc_head_*`` -> ``mtp.{S-1}.*``; others (``embed.weight``, ``head.weight``, the target's) unchanged."""
    if view_name in _LAST_STAGE_GLOBALS:
        return f"mtp.{stages - 1}.{view_name}"
    return _STAGE.sub(r"mtp.\1.", view_name)


def _view_name(name: str, stages: int) -> str | None:
    """Inverse of :func:`checkpoint_name` for a stage tensor (None for names outside the stage view)."""
    last = f"mtp.{stages - 1}."
    if name.startswith(last) and name[len(last):] in _LAST_STAGE_GLOBALS:
        return name[len(last):]
    if name in ("embed.weight", "head.weight"):
        return name
    match = _MTP.match(name)
    return _MTP.sub(r"layers.\1.", name) if match and int(match.group(1)) < stages else None


def extra_formats(config: ModelConfig, q: QuantFormat) -> list[TensorFormat]:
    """The drafter's own tensors (main_proj, main_norm, Markov and confidence heads) in ``q``'s stored formats."""
    block = set(weight_specs(stage_config(config)))
    return [f for f in draft_formats(config, q, draft_layout(config))
            if _view_name(f.name, config.n_mtp_layers) not in block]


class DrafterRandomSource(RandomSource):
    """Deterministic random drafter tensors: the stage view's names seeded by their checkpoint names (``mtp.*``),
    so a synthetic checkpoint written from it holds the same values, plus the drafter's own tensors."""

    def __init__(self, config: ModelConfig, seed: int):
        super().__init__(stage_config(config), seed, share_layers=False)
        self.stages = config.n_mtp_layers
        self.own = {f.name: TensorSpec(f.shape) for f in extra_formats(config, QuantFormat.float_checkpoint())}
        self.specs = self.specs | self.own

    def seed_name(self, name: str) -> str:
        return name if name in self.own else checkpoint_name(name, self.stages)

    def load_checkpoint_name(self, name: str) -> np.ndarray:
        """The value of checkpoint tensor ``name`` (``mtp.*``; a stage tensor or one of the drafter's own)."""
        view = name if name in self.own else _view_name(name, self.stages)
        if view is None:
            raise KeyError(f"{name} is not a tensor of the drafter")
        return self.load(view)


class _Renamed(ShardIndex):
    """A :class:`ShardIndex` whose tensors are another's under the stage view's names (headers shared, nothing
    read); every reader of the target's loader then works on it unchanged. The view's ``embed.weight`` and
    ``head.weight`` are the target's, which the drafter never reads: when the shards do not hold them (the
    drafter's shards alone), header-only stand-ins of their shape satisfy the view's validation."""

    def __init__(self, shards: ShardIndex, config: ModelConfig):
        self.unreadable = []
        stages = config.n_mtp_layers
        self._stored = {}
        for name, st in shards._stored.items():
            base = name.removesuffix(".scale")
            view = _view_name(base, stages)
            if view is not None:
                self._stored[view + name[len(base):]] = st
        shape = (config.vocab_size, config.hidden_size)
        for name in ("embed.weight", "head.weight"):
            self._stored.setdefault(name, StoredTensor(name, Path("(the target's, never read)"), "BF16", shape, 0, 0))


@attrs.frozen(eq=False)
class DrafterWeights:
    """Every drafter tensor of a DSpark ``config`` (the target's config; the stages' is :func:`stage_config`).

    stages: the draft stages as the layers of a :class:`ModelWeights` (``stages.layer(s)``: stage s's
    :class:`~dspark_kernels.model.weights.LayerWeights`, read when asked; kept or streamed as the source says).
    main_proj [D, T*D], main_norm [D], markov_w1 / markov_w2 [V, r], confidence [1, D + r] or None: float32
    (dequantised). main_proj_fp8: whether main_proj is stored FP8 as loaded (precision ``"deepseek"`` then
    quantises its input in 1x128 blocks, as every FP8 Linear).
    """

    config: ModelConfig
    stages: ModelWeights
    main_proj: np.ndarray
    main_norm: np.ndarray
    markov_w1: np.ndarray
    markov_w2: np.ndarray
    confidence: np.ndarray | None
    main_proj_fp8: bool = False

    @property
    def num_stages(self) -> int:
        return self.config.n_mtp_layers

    def stage(self, s: int) -> LayerWeights:
        """Stage ``s``'s block weights (``mtp.{s}.*``)."""
        return self.stages.layer(s)

    def head_hc(self) -> HcWeights:
        """The last stage's own ``hc_head_*`` mixer."""
        t = self.stages.tensor
        return HcWeights(t("hc_head_fn"), t("hc_head_scale"), t("hc_head_base"))

    def head_norm(self) -> np.ndarray:
        """The last stage's ``norm.weight`` [D]."""
        return self.stages.tensor("norm.weight")

    # ------------------------------------------------------------------ construction
    @classmethod
    def random(cls, config: ModelConfig, seed: int = 0, *, keep_layers: bool = True) -> DrafterWeights:
        """Deterministic random drafter weights (bf16 values; the rules of :meth:`ModelWeights.random`)."""
        source = DrafterRandomSource(config, seed)
        stages = ModelWeights(stage_config(config), source, keep_layers=keep_layers)
        own = {n: stages.tensor(n) for n in source.own}
        return cls._assemble(config, stages, own, fp8=False)

    @classmethod
    def from_safetensors(cls, paths: str | Path | Iterable[str | Path], config: ModelConfig, *,
                         keep_layers: bool = False) -> DrafterWeights:
        """The drafter of a checkpoint (folder, shard or shard list) in its stored formats, streamed like the
        target's (:meth:`ModelWeights.from_safetensors`): headers checked now, stage tensors read when a stage
        runs. Raises :class:`WeightsError` naming every missing or mis-stored ``mtp.*`` tensor (a checkpoint without
        a drafter: run without speculation)."""
        stage_cfg = stage_config(config)
        shards = ShardIndex(paths if isinstance(paths, str | Path) else [Path(p) for p in paths])
        if not any(n.startswith("mtp.") for n in shards.names):
            raise WeightsError([Issue("array.missing", "mtp.*", "the checkpoint holds no DSpark drafter tensors",
                                      expected=f"{config.n_mtp_layers} draft stages (mtp.0 .. mtp."
                                      f"{config.n_mtp_layers - 1})", actual="no mtp.* tensor",
                                      fix="run without speculation (no drafter), or add the drafter's shards "
                                      "(46-48 of DeepSeek-V4-Flash-DSpark)")],
                               config_name=f"{config.name} drafter", required=1)
        own = extra_formats(config, QuantFormat(quantized=True))
        report = shards.validate(own)
        try:
            stages = ModelWeights(stage_cfg, _Renamed(shards, config), keep_layers=keep_layers)
        except WeightsError as exc:
            issues = [attrs.evolve(i, field=checkpoint_name(i.field, config.n_mtp_layers)) for i in exc.issues]
            raise WeightsError(issues + list(report.issues), config_name=f"{config.name} drafter",
                               required=exc.required + len(own)) from None
        if not report.ok:
            raise WeightsError(report.issues, config_name=f"{config.name} drafter", required=len(own))
        tensors = {f.name: shards.tensor(f.name) for f in own if f.name in shards}
        fp8 = shards.kind(own[0].name) == "fp8_block"
        return cls._assemble(config, stages, tensors, fp8=fp8)

    @classmethod
    def _assemble(cls, config: ModelConfig, stages: ModelWeights, own: dict[str, Any], *, fp8: bool
                  ) -> DrafterWeights:
        first, last = "mtp.0.", f"mtp.{config.n_mtp_layers - 1}."
        confidence = own.get(last + "confidence_head.proj.weight")
        return cls(config=config, stages=stages, main_proj=own[first + "main_proj.weight"],
                   main_norm=own[first + "main_norm.weight"], markov_w1=own[last + "markov_head.markov_w1.weight"],
                   markov_w2=own[last + "markov_head.markov_w2.weight"], confidence=confidence, main_proj_fp8=fp8)

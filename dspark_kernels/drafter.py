"""The DSpark drafter of DeepSeek-V4-Flash-DSpark on the reference backend: :class:`DSparkDrafter`.

What one draft of R requests computes (DeepSeek's ``Transformer.forward_spec`` / ``DSparkBlock`` restated; S draft
stages, B = ``dspark_block_size``, D hidden, T target layers, W window, r Markov rank, V vocabulary):

1. **observe** (committed rows only, prefill and accepted verify rows): ``main_x = rms_norm(main_proj(features),
   main_norm)`` [n, D] from the target features [n, T*D]; each stage's window key of every row
   (:func:`~dspark_kernels.reference.draft_attention.context_keys`) into that stage's layer of the window cache at
   the row's ``ori`` slot (:class:`~dspark_kernels.model.drafter_cache.DrafterWindow`: the S stages are S more layers
   of the target's ``ori`` pool, addressed through the persistent tables the drafter is attached to, spec 5.10).
   Nothing else runs: a prefill only seeds the window.
2. **draft**: the block ``[anchor, noise x (B - 1)]`` at positions ``a .. a + B - 1`` (a = last observed + 1),
   embedded with the target's embedding and copied to the hc streams; per stage a V4 block: hc_pre, attn_norm,
   draft attention (:func:`~dspark_kernels.reference.draft_attention.block_attention`: the window of the last W
   committed rows, gathered from the ``ori`` slots in ring-slot order (slot ``q mod W``), plus every block row,
   non-causal), hc_post; hc_pre, ffn_norm, MoE, hc_post (the backend's stages, as a target layer).
3. **head**: ``h = hc_head(x_hc)`` with the last stage's own mixer, ``logits = rms_norm(h, norm) @ head.T`` (the
   target's LM head, fp32); then left to right over the B rows the Markov head adds ``markov_w2 @
   markov_w1[previous]`` (previous = the anchor for row 0, else the previous row's choice) and takes the argmax
   (first maximum): drafts d_1 .. d_B. ``confidence = proj([h ; markov_w1[previous]])``, a raw fp32 logit per row.

The choice is greedy (the first maximum): DeepSeek's ``forward_head`` samples each row with its temperature
(Gumbel-max), of which greedy is the temperature-0 case, the one a verify step's greedy acceptance checks.

Backends: the stages shared with the target run on the drafter's :class:`~dspark_kernels.model.backends.Backend`
(``backend="pypto"``: the pypto kernels, in their ``a2a3`` numerics): hc_pre with the fused attn_norm / ffn_norm,
hc_post, the MoE (gate, routed and shared experts), the head's hc_head and hc_head + RMSNorm, and the LM head's
logits. The drafter's own stages are registered per backend in :data:`DRAFTER_STAGES`: ``main_x``
(:mod:`dspark_kernels.reference.observe`; on pypto :mod:`dspark_kernels.pypto.observe`, the shared kv kernel
without RoPE), the window keys of ``observe`` (the target's shared kv kernel on pypto), the draft attention (on
pypto :mod:`dspark_kernels.pypto.draft_attention`: its key set, ring slots plus block rows, non-causal, is the
sparse-attention kernel's window + entry-row form) and the Markov and confidence heads
(:mod:`dspark_kernels.reference.markov`; on pypto :mod:`dspark_kernels.pypto.markov`, the B rows left to right
inside one kernel). On every backend the FP8 step of the drafter's keys runs on the host in numpy (the target's
a2a3 kernels have none to reuse).

All requests' blocks run packed, in one call. Under TP (``tp`` > 1) the R*B block rows are split into contiguous
rank shares for the query side of attention and for the MoE, whose outputs are all-gathered rank-major, and the
LM head is split by vocabulary (the target's TP, docs/architecture.md); keys, the gathered window and
hyper-connections are computed by every rank (replicated).
"""

from __future__ import annotations

import importlib
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import attrs
import numpy as np

from dspark_abi import ABIError, Issue, ModelConfig
from dspark_abi.persistent import PersistentTables
from dspark_kernels.model.backends import REGISTRY, Backend, default_backend, resolve_backend
from dspark_kernels.model.block_weights import HeadWeights
from dspark_kernels.model.drafter_cache import DrafterWindow
from dspark_kernels.model.drafter_weights import DrafterWeights, drafter_issues, stage_config
from dspark_kernels.model.forward import TargetReduction
from dspark_kernels.model.geometry import vocab_shard, vocab_shard_width
from dspark_kernels.model.numerics import Precision, check_precision
from dspark_kernels.model.prepared import PreparedWeightsCache
from dspark_kernels.model.rope import rope_at
from dspark_kernels.model.tp import ThreadGroup, torch_all_gather
from dspark_kernels.model.weights import ModelWeights

#: ``all_gather(local [L, ...]) -> [TP * L, ...]`` (rank-major), as the target's layers use.
AllGather = Callable[[np.ndarray], np.ndarray]
TpMode = Literal["single", "threads", "distributed"]
TP_MODES: tuple[TpMode, ...] = ("single", "threads", "distributed")
#: The drafter's own stages of each backend of the registry, {backend: {stage: (module, function)}}, imported
#: when a drafter is built: stages only the drafter has, so they are registered beside the backend registry rather
#: than in the Backend protocol. Each function has the signature of its reference: ``main_x``
#: (:func:`dspark_kernels.reference.observe.main_x`), ``context_keys`` (the window keys of observed rows,
#: :func:`dspark_kernels.reference.draft_attention.context_keys`), ``attention``
#: (:func:`dspark_kernels.reference.draft_attention.block_attention`), ``markov`` (the Markov and confidence heads,
#: :func:`dspark_kernels.reference.markov.markov_heads`).
DRAFTER_STAGES: dict[str, dict[str, tuple[str, str]]] = {
    "reference": {"main_x": ("dspark_kernels.reference.observe", "main_x"),
                  "context_keys": ("dspark_kernels.reference.draft_attention", "context_keys"),
                  "attention": ("dspark_kernels.reference.draft_attention", "block_attention"),
                  "markov": ("dspark_kernels.reference.markov", "markov_heads")},
    "pypto": {"main_x": ("dspark_kernels.pypto.observe", "main_x_isolated"),
              "context_keys": ("dspark_kernels.pypto.observe", "context_keys_isolated"),
              "attention": ("dspark_kernels.pypto.draft_attention", "block_attention_isolated"),
              "markov": ("dspark_kernels.pypto.markov", "markov_heads_isolated")}}


def __getattr__(name: str) -> object:
    if name == "DRAFT_ATTENTION":
        warnings.warn("dspark_kernels.drafter.DRAFT_ATTENTION is deprecated: the drafter's stages are registered "
                      "in DRAFTER_STAGES (its 'attention' entries)", DeprecationWarning, stacklevel=2)
        return {backend: stages["attention"] for backend, stages in DRAFTER_STAGES.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@attrs.frozen(eq=False)
class DraftOutput:
    """One draft of R requests.

    tokens: [R, B] int64 drafts d_1 .. d_B per request (B = ``dspark_block_size``).
    confidence: [R, B] float32 raw confidence logits (no sigmoid), one per block row; zeros when the checkpoint
    has no confidence head.
    """

    tokens: np.ndarray
    confidence: np.ndarray


@attrs.frozen
class DrafterRecipe:
    """How a :class:`DSparkDrafter` was made, small and picklable: what a TP rank process needs to build its own
    drafter on its own target weights (the drafter's weights are regenerated or re-read there, never shipped).

    config: the target's DSpark config; seed: random weights (:meth:`DSparkDrafter.random`) or checkpoint: a
    checkpoint folder (:meth:`DSparkDrafter.from_checkpoint`, with ``keep_layers``; a path the rank processes
    can read); precision, backend (a registry name) as the drafter's. It builds a :class:`DSparkDrafter`, never a
    subclass."""

    config: ModelConfig
    seed: int | None = None
    checkpoint: str | None = None
    precision: str = "fp32"
    backend: str = "reference"
    keep_layers: bool = False

    def build(self, target: ModelWeights, *, tp: int = 1, tp_mode: TpMode = "single") -> DSparkDrafter:
        """The drafter this recipe describes on ``target``, in a TP group of ``tp`` ranks run as ``tp_mode``."""
        if self.checkpoint is not None:
            return DSparkDrafter.from_checkpoint(self.checkpoint, self.config, target, precision=self.precision,
                                                 tp=tp, tp_mode=tp_mode, backend=self.backend,
                                                 keep_layers=self.keep_layers)
        return DSparkDrafter.random(self.config, target, self.seed or 0, precision=self.precision, tp=tp,
                                    tp_mode=tp_mode, backend=self.backend)


def _registry_name(backend: Backend) -> str | None:
    """The registry name of a backend object (its class's entry in the backend registry), None if unregistered."""
    kind = (type(backend).__module__, type(backend).__qualname__)
    return next((name for name, entry in REGISTRY.items() if entry == kind), None)


def _share(rows: int, tp: int, rank: int) -> slice:
    """Rank ``rank``'s contiguous share of ``rows`` rows: ``ceil(rows / tp)`` rows (fewer at the end)."""
    per = -(-rows // tp)
    return slice(min(rank * per, rows), min((rank + 1) * per, rows))


def _process_group_rank(tp: int) -> tuple[int, AllGather]:
    """This process's rank and the all-gather of the initialised ``torch.distributed`` group of ``tp`` ranks."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() != tp:
        raise ABIError([Issue("config.invalid", "tp_mode", "tp_mode 'distributed' runs inside an initialised "
                              "torch.distributed group of tp processes", expected=tp,
                              actual=dist.get_world_size() if dist.is_initialized() else "not initialised",
                              fix="initialise the process group (e.g. under torchrun) or use tp_mode 'threads'")])
    return dist.get_rank(), torch_all_gather()


def _gather_rows(local: np.ndarray, rows: int, tp: int, all_gather: AllGather | None) -> np.ndarray:
    """All ranks' shares [<= L, ...] padded to L = ceil(rows / tp), gathered rank-major, cut to ``rows``."""
    if all_gather is None or tp == 1:
        return local
    per = -(-rows // tp)
    padded = np.zeros((per, *local.shape[1:]), local.dtype)
    padded[: local.shape[0]] = local
    return all_gather(padded)[:rows]


class DSparkDrafter:
    """The DSpark drafter of a target model: weights, the window cache and the stages that draft.

    config: the target's DSpark :class:`ModelConfig` (``dspark_*`` keys, ``n_mtp_layers``); weights: the
    :class:`DrafterWeights`; target: the target's :class:`ModelWeights` (embedding and LM head are shared);
    precision: ``"fp32"`` (default), ``"deepseek"`` (the release's bf16 activations and FP8 inputs) or ``"a2a3"``
    (the a2a3 kernels' numerics: bf16 weights and activations between stages, ``main_x`` included, fp32
    accumulation; the Markov and confidence heads in fp32);
    backend: a :class:`Backend`, or a registry name (``"reference"``, ``"pypto"``: resolved for ``precision``,
    ``config.invalid`` when the backend cannot compute it; the pypto kernels compute ``"a2a3"``), default the
    reference;
    tp / tp_mode: the TP group size and how its ranks run
    (``"single"``: one process computes the whole group; ``"threads"``: one thread per rank, all-gathers in
    memory; ``"distributed"``: this process is one rank of an initialised ``torch.distributed`` group of ``tp``
    processes, each holding its own drafter and calling the same methods with the same arguments, all-gathers
    through the process group). Every rank holds a replicated window cache.

    The window cache lives in the ``ori`` pool of persistent tables (:meth:`attach`, spec 5.10): attach the
    allocator's tables (``drafter.attach(allocator.persistent)``) and observe a step's committed rows and draft
    for a request before that request's next step is built (R75, ``drafter.unmapped``).
    """

    #: The target-feature reduction the drafter was trained on (DeepSeek's ``h.mean(dim=2)``): what
    #: :func:`~dspark_kernels.model.forward.target_features` computes by default and ``observe`` expects.
    reduction: TargetReduction = "mean"

    def __init__(self, config: ModelConfig, weights: DrafterWeights, target: ModelWeights, *,
                 precision: str = "fp32", tp: int = 1, tp_mode: TpMode = "single",
                 backend: Backend | str | None = None):
        issues = drafter_issues(config)
        if weights.config != config or target.config != config:
            issues.append(Issue("config.mismatch", "weights", "drafter and target weights must be of the config",
                                expected=config.name, actual=[weights.config.name, target.config.name]))
        if tp < 1 or tp_mode not in TP_MODES:
            issues.append(Issue("config.invalid", "tp", "tp is a group size >= 1 run in one of the TP modes",
                                expected=f"tp >= 1, tp_mode in {list(TP_MODES)}", actual=[tp, tp_mode]))
        if issues:
            raise ABIError(issues)
        self.config, self.weights, self.target = config, weights, target
        self.stage_config = stage_config(config)
        self.precision: Precision = check_precision(precision)
        self.tp, self.tp_mode = tp, tp_mode
        self.backend = resolve_backend(backend, precision) if isinstance(backend, str) else default_backend(backend)
        name = backend if isinstance(backend, str) else _registry_name(self.backend)
        if name not in DRAFTER_STAGES:
            raise ABIError([Issue("config.invalid", "backend", "the drafter's stages are registered for the "
                                  "backends of the registry", expected=list(DRAFTER_STAGES),
                                  actual=type(self.backend).__qualname__)])
        stages = {stage: getattr(importlib.import_module(module), function)
                  for stage, (module, function) in DRAFTER_STAGES[name].items()}
        self._main_x: Callable[..., np.ndarray] = stages["main_x"]
        self._context_keys: Callable[..., np.ndarray] = stages["context_keys"]
        self._attention: Callable[..., np.ndarray] = stages["attention"]
        self._markov_heads: Callable[..., tuple[np.ndarray, np.ndarray]] = stages["markov"]
        self.window_cache = DrafterWindow(config)
        self._prepared = PreparedWeightsCache(keep=weights.stages.keep_layers)
        self.recipe: DrafterRecipe | None = None
        """How :meth:`random` / :meth:`from_checkpoint` made the drafter (a TP rank process builds its own from it);
        None when the weights were passed in."""
        self._backend_name = name

    @property
    def rings(self) -> DrafterWindow:
        """Deprecated (1.4): the per-request rings became the window cache in the ``ori`` pool,
        :attr:`window_cache`."""
        warnings.warn("DSparkDrafter.rings is deprecated: the window lives in the ori pool; use "
                      "DSparkDrafter.window_cache", DeprecationWarning, stacklevel=2)
        return self.window_cache

    # ------------------------------------------------------------------ construction
    @classmethod
    def random(cls, config: ModelConfig, target: ModelWeights, seed: int = 0, *, precision: str = "fp32",
               tp: int = 1, tp_mode: TpMode = "single", backend: Backend | str | None = None) -> DSparkDrafter:
        """A drafter with :meth:`DrafterWeights.random` weights (``seed``) on ``target``."""
        drafter = cls(config, DrafterWeights.random(config, seed), target, precision=precision, tp=tp,
                      tp_mode=tp_mode, backend=backend)
        drafter.recipe = DrafterRecipe(config, seed=seed, precision=precision, backend=drafter._backend_name)
        return drafter

    @classmethod
    def from_checkpoint(cls, path: str | Path, config: ModelConfig, target: ModelWeights, *,
                        precision: str = "fp32", tp: int = 1, tp_mode: TpMode = "single",
                        backend: Backend | str | None = None, keep_layers: bool = False) -> DSparkDrafter:
        """The drafter of a checkpoint folder (``mtp.*`` tensors: :meth:`DrafterWeights.from_safetensors`; streamed,
        or with ``keep_layers`` every stage kept once read, which saves re-reading them at every draft)."""
        drafter = cls(config, DrafterWeights.from_safetensors(path, config, keep_layers=keep_layers), target,
                      precision=precision, tp=tp, tp_mode=tp_mode, backend=backend)
        drafter.recipe = DrafterRecipe(config, checkpoint=str(path), precision=precision,
                                       backend=drafter._backend_name, keep_layers=keep_layers)
        return drafter

    # ------------------------------------------------------------------ observe
    def main_x(self, features: np.ndarray) -> np.ndarray:
        """``rms_norm(main_proj(features), main_norm)`` [n, D] float32 of target features [n, T*D] (bf16 values in
        a2a3 and deepseek; :func:`dspark_kernels.reference.observe.main_x`, through the backend's registered
        stage)."""
        w = self.weights
        return self._main_x(features, w.main_proj, w.main_norm, self.config.rms_norm_eps, self.precision,
                            w.main_proj_fp8)

    def attach(self, tables: PersistentTables) -> None:
        """The persistent tables whose ``ori`` pool the drafter's window lives in (the allocator's
        ``BlockAllocator.persistent``, or a rank's mirror of them; spec 5.10). The first attach allocates the window
        cache [S, pool_blocks.ori * 32, head_dim] float32 (zeros); tables of another ``ori`` geometry, or of another
        ``ori`` block count while requests are observed, are ``config.mismatch`` and nothing changes."""
        self.window_cache.attach(tables)

    def observe(self, request_ids: Sequence[int], positions: Sequence[np.ndarray],
                features: Sequence[np.ndarray]) -> None:
        """Write committed rows into every stage's layer of the window cache (one packed call for all requests).

        positions[i]: [n_i] int64 ascending contiguous absolute positions of request ``request_ids[i]``;
        features[i]: [n_i, T*D] float32 its target features (the mean of the hc streams after each target layer).
        A request's rows must continue its history (a new request starts at 0): else ``drafter.gap``; wrong shapes
        ``array.shape``; rows the window keeps (each request's last W of the call) outside the request's current
        ``ori`` run of the attached tables, or no tables attached: ``drafter.unmapped`` (observe a step's rows after
        its commit, before the request's next step is built); nothing is written on any error.
        """
        c, cache = self.config, self.window_cache
        pos = [np.asarray(p, dtype=np.int64).reshape(-1) for p in positions]
        feats = [np.asarray(f, dtype=np.float32) for f in features]
        width = len(c.dspark_target_layers) * c.hidden_size
        issues = []
        if not len(request_ids) == len(pos) == len(feats):
            issues.append(Issue("array.shape", "positions", "one positions and one features array per request",
                                expected=len(request_ids), actual=[len(pos), len(feats)]))
        else:
            issues += [Issue("array.shape", "features", "target features are [n_i, T*D] for n_i positions", index=i,
                             request=int(r), expected=[p.size, width], actual=list(f.shape),
                             fix="pass the target_hidden rows of the request's committed positions")
                       for i, (r, p, f) in enumerate(zip(request_ids, pos, feats, strict=True))
                       if f.shape != (p.size, width)]
            issues += [Issue("positions.out_of_range", "positions", "positions must be below the position limit",
                             index=i, request=int(r), expected=f"< {c.max_position_embeddings}",
                             actual=int(p[-1])) for i, (r, p) in enumerate(zip(request_ids, pos, strict=True))
                       if p.size and p[-1] >= c.max_position_embeddings]
            issues += cache.gap_issues(request_ids, pos)
        if issues:
            raise ABIError(issues)
        before = [cache.last.get(int(r), -1) for r in request_ids]
        ends = np.array([int(p[-1]) if p.size else b for p, b in zip(pos, before, strict=True)], dtype=np.int64)
        # only each request's last W rows can stay in the window: the others are never computed
        keep = [p >= e - cache.window + 1 for p, e in zip(pos, ends, strict=True)]
        kept_pos = np.concatenate([p[k] for p, k in zip(pos, keep, strict=True)]) if pos else np.zeros(0, np.int64)
        owner = np.repeat(np.arange(len(pos)), [int(k.sum()) for k in keep])
        rows = cache.rows_of(request_ids, owner, kept_pos, "positions", "would write")   # R75, before any work
        keys = []
        if kept_pos.size:   # every stage's keys before anything is written: a failed read leaves the cache as it was
            x = self.main_x(np.concatenate([f[k] for f, k in zip(feats, keep, strict=True)]))   # (N, D)
            cos, sin = rope_at(c, "swa", kept_pos, self.precision)
            for s in range(c.n_mtp_layers):
                w = self._prepared.get(self.weights.stage(s).attn, self.precision)
                keys.append(self._context_keys(x, w, cos, sin, c.rms_norm_eps, self.precision))  # (N, hd)
        for s, stage_keys in enumerate(keys):
            cache.write(s, rows, stage_keys)
        cache.advance(request_ids, ends)

    def release(self, request_ids: Sequence[int]) -> None:
        """Forget requests (``drafter.unknown_request`` for an id never observed; nothing changes then)."""
        self.window_cache.release(request_ids)

    # ------------------------------------------------------------------ draft
    def draft(self, request_ids: Sequence[int], anchors: np.ndarray, anchor_positions: np.ndarray) -> DraftOutput:
        """Draft B tokens for every request after its anchor, packed in one call.

        anchors: [R] int64, the token after each request's last observed row; anchor_positions: [R] int64, that
        row's position + 1. Raises ``drafter.unknown_request`` / ``drafter.gap`` (an anchor position that is not
        last observed + 1) / ``token_ids.range`` / ``drafter.unmapped`` (a window row outside the request's current
        ``ori`` run: draft before the request's next step is built); nothing changes (draft never writes the cache).
        """
        c, b, cache = self.config, self.config.dspark_block_size, self.window_cache
        anchors = np.asarray(anchors, dtype=np.int64).reshape(-1)
        at = np.asarray(anchor_positions, dtype=np.int64).reshape(-1)
        last = cache.check_known(request_ids)
        issues = []
        if anchors.shape != (len(request_ids),) or at.shape != anchors.shape:
            raise ABIError([Issue("array.shape", "anchors", "one anchor and one anchor position per request",
                                  expected=[len(request_ids)], actual=[list(anchors.shape), list(at.shape)])])
        expected = last + 1
        ids = [int(r) for r in request_ids]
        issues += [Issue("drafter.gap", "anchor_positions", "the anchor must follow the last observed row", index=i,
                         request=ids[i], expected=int(expected[i]), actual=int(at[i]),
                         fix="observe every committed row before drafting")
                   for i in np.flatnonzero(at != expected).tolist()]
        issues += [Issue("token_ids.range", "anchors", "anchors must be vocabulary ids", index=i,
                         request=ids[i], expected=f"[0, {c.vocab_size})", actual=int(anchors[i]))
                   for i in np.flatnonzero((anchors < 0) | (anchors >= c.vocab_size)).tolist()]
        issues += [Issue("positions.out_of_range", "anchor_positions", "the block's rows pass the position limit",
                         index=i, request=ids[i], expected=f"<= {c.max_position_embeddings - b}",
                         actual=int(at[i])) for i in np.flatnonzero(at + b > c.max_position_embeddings).tolist()]
        if issues:
            raise ABIError(issues)
        if anchors.size == 0:
            return DraftOutput(np.zeros((0, b), np.int64), np.zeros((0, b), np.float32))
        window = cache.gather(*cache.window_rows(request_ids, at))      # (S, R, W, D): R75 checked first
        if self.tp == 1 or self.tp_mode == "single":
            return self._draft_rank(window, anchors, at, None, None)
        if self.tp_mode == "distributed":
            return self._draft_rank(window, anchors, at, *_process_group_rank(self.tp))
        group = ThreadGroup(self.tp)
        results: list[DraftOutput | BaseException | None] = [None] * self.tp

        def run(rank: int) -> None:
            try:
                results[rank] = self._draft_rank(window, anchors, at, rank, group.gatherer(rank))
            except BaseException as exc:
                results[rank] = exc
                group.abort()

        threads = [threading.Thread(target=run, args=(k,)) for k in range(self.tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for res in results:
            if isinstance(res, BaseException):
                raise res
        first = results[0]
        if not isinstance(first, DraftOutput):
            raise RuntimeError("a TP rank returned no draft")
        return first

    def _draft_rank(self, window: np.ndarray, anchors: np.ndarray, at: np.ndarray, rank: int | None,
                    all_gather: AllGather | None) -> DraftOutput:
        """One rank's view of a draft (rank None: the whole group); every rank returns the same output. window:
        [S, R, W, D] float32 each stage's window keys of every request in ring-slot order
        (:meth:`DrafterWindow.gather`)."""
        c, sc, prec, st = self.config, self.stage_config, self.precision, self.backend
        r, b = anchors.size, c.dspark_block_size
        tp = 1 if rank is None else self.tp
        rows = _share(r * b, tp, 0 if rank is None else rank)
        ids = np.full((r, b), c.dspark_noise_token_id, np.int64)
        ids[:, 0] = anchors
        positions = (at[:, None] + np.arange(b)[None, :]).reshape(-1)                         # (R*B,)
        cos, sin = rope_at(c, "swa", positions, prec)
        x_hc = np.repeat(self.target.embed_rows(ids.reshape(-1))[:, None, :], c.hc_mult, axis=1)  # (R*B, hc, D)
        visible = np.minimum(self.window_cache.window, at)
        for s in range(c.n_mtp_layers):
            lw = self.weights.stage(s)
            w = self._prepared.get(lw.attn, prec)
            pre = st.hc_pre(x_hc, lw.hc_attn, sc, precision=prec, norm=lw.attn_norm)
            if pre.x_normed is None:
                raise ValueError("the backend's hc_pre returned no x_normed although it was given the norm")
            attn = self._attention(pre.x_normed, window[s], visible, w, cos, sin,
                                   heads=c.num_attention_heads, eps=c.rms_norm_eps, scale=c.softmax_scale,
                                   precision=prec, rows=rows)
            x_hc = st.hc_post(_gather_rows(attn, r * b, tp, all_gather), x_hc, pre.post, pre.comb, precision=prec)
            ffn = st.hc_pre(x_hc, lw.hc_ffn, sc, precision=prec)
            out = st.moe(ffn.x_mixed[rows], lw.moe, sc, norm=lw.ffn_norm, precision=prec)
            x_hc = st.hc_post(_gather_rows(out, r * b, tp, all_gather), x_hc, ffn.post, ffn.comb, precision=prec)
        head = HeadWeights(self.weights.head_hc(), self.weights.head_norm(), self.target.head().head)
        h = st.hc_head(x_hc, head.hc, sc, precision=prec)                                      # (R*B, D)
        hidden = st.final_hidden(x_hc, head, sc, precision=prec)   # rms_norm(h, norm): the backend's fused head
        logits = self._logits(hidden, head.head, rank, all_gather).reshape(r, b, -1)           # (R, B, V)
        return self._markov(logits, h.reshape(r, b, -1), anchors)

    def _logits(self, hidden: np.ndarray, head: np.ndarray, rank: int | None, all_gather: AllGather | None
                ) -> np.ndarray:
        """[R*B, V] fp32 LM-head logits of every row (the target's head [V, D], through the backend's
        ``logits_for_rows``; vocabulary shards gathered under TP)."""
        v, every_row = self.config.vocab_size, np.arange(hidden.shape[0])
        if rank is None or all_gather is None or self.tp == 1:
            return self.backend.logits_for_rows(hidden, every_row, head)
        width = vocab_shard_width(v, self.tp)
        shard = np.full((hidden.shape[0], width), -np.inf, np.float32)
        part = self.backend.logits_for_rows(hidden, every_row, head[vocab_shard(v, self.tp, rank)])
        shard[:, : part.shape[1]] = part
        return np.ascontiguousarray(all_gather(np.ascontiguousarray(shard.T)).T[:, :v])

    def _markov(self, logits: np.ndarray, h: np.ndarray, anchors: np.ndarray) -> DraftOutput:
        """Greedy drafts and confidences from base logits [R, B, V] and pre-norm head rows h [R, B, D]."""
        w = self.weights
        proj = None if w.confidence is None else w.confidence[0]                               # (D + r,)
        return DraftOutput(*self._markov_heads(logits, h, anchors, w.markov_w1, w.markov_w2, proj))

    # ------------------------------------------------------------------ the speculative.Drafter protocol
    def propose(self, request_ids: Sequence[int], contexts: Sequence[np.ndarray],
                max_drafts: Sequence[int]) -> list[np.ndarray]:
        """The ``speculative.Drafter`` protocol: anchor = ``contexts[i][-1]`` at position ``len(contexts[i]) - 1``
        (the rows before it observed); returns ``draft(...).tokens[i, :max_drafts[i]]``."""
        anchors = np.array([int(np.asarray(ctx)[-1]) for ctx in contexts], dtype=np.int64)
        at = np.array([len(ctx) - 1 for ctx in contexts], dtype=np.int64)
        out = self.draft(request_ids, anchors, at)
        return [out.tokens[i, : int(k)] for i, k in enumerate(max_drafts)]

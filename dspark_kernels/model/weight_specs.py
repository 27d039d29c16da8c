"""The tensors the whole model reads, by DeepSeek-V4 checkpoint name (:func:`weight_specs`), and the error
raised for weights that cannot serve a config (:class:`WeightsError`).

## ModelWeights

Names (as DeepSeek-V4's ``inference/model.py`` and ``convert.py`` produce them; [out, in] layouts; D hidden,
hc streams, mix = (2 + hc) * hc, V vocab, E routed experts, K experts per token, I expert width, S shared experts):

=============================================  ==================  =========================================
name                                           shape               notes
=============================================  ==================  =========================================
``embed.weight``                               [V, D]
``layers.{i}.attn.*``                          attention_weights   :class:`AttentionWeights` (per layer kind)
``layers.{i}.attn_norm.weight``                [D]
``layers.{i}.ffn_norm.weight``                 [D]
``layers.{i}.hc_attn_fn`` / ``hc_ffn_fn``      [mix, hc*D]         fp32 in the checkpoint
``layers.{i}.hc_attn_scale`` / ``hc_ffn_scale`` [3]
``layers.{i}.hc_attn_base`` / ``hc_ffn_base``  [mix]
``layers.{i}.ffn.gate.weight``                 [E, D]
``layers.{i}.ffn.gate.bias``                   [E]                 learned-gate layers (i >= num_hash_layers)
``layers.{i}.ffn.gate.tid2eid``                [V, K] int          hash layers (i < num_hash_layers)
``layers.{i}.ffn.experts.{e}.w1/w3.weight``    [I, D]
``layers.{i}.ffn.experts.{e}.w2.weight``       [D, I]
``layers.{i}.ffn.shared_experts.w1/w3.weight`` [S*I, D]            absent when S = 0
``layers.{i}.ffn.shared_experts.w2.weight``    [D, S*I]
``norm.weight``                                [D]
``head.weight``                                [V, D]
``hc_head_fn`` / ``hc_head_scale`` / ``hc_head_base``  [hc, hc*D] / [1] / [hc]
=============================================  ==================  =========================================

Float tensors may be float16, bfloat16, float32 or float64 and are computed with as float32; ``tid2eid`` is
int32 or int64. A checkpoint folder is read in its stored formats (FP8 / FP4 / int8 with ``.scale`` companions,
:meth:`ModelWeights.from_safetensors`); an in-memory mapping (``from_tensors``) holds floats. Names the
model does not use (``mtp.*``, scales) are ignored: the DSpark drafter's ``mtp.*`` tensors are
:class:`~dspark_kernels.model.drafter_weights.DrafterWeights`', read as the layers of a stage config with these
same specs (:func:`~dspark_kernels.model.drafter_weights.stage_config`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from dspark_abi import ABIError, Issue, ModelConfig
from dspark_kernels.model.attention_weights import AttentionWeights, expected_shapes


@attrs.frozen
class TensorSpec:
    """Expected shape and dtype family ('float' or 'int') of one checkpoint tensor."""

    shape: tuple[int, ...]
    family: str = "float"


def weight_specs(config: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor the model reads, checkpoint name -> :class:`TensorSpec` (the table in the module docstring)."""
    c, m = config, config.moe
    d, hc, v = c.hidden_size, c.hc_mult, c.vocab_size
    mix, inter, shared = (2 + hc) * hc, m.moe_intermediate_size, m.n_shared_experts * m.moe_intermediate_size
    out = {"embed.weight": TensorSpec((v, d))}
    for i in range(c.num_layers):
        p = f"layers.{i}."
        out |= {AttentionWeights.prefix(i) + n: TensorSpec(s) for n, s in expected_shapes(c, i).items()}
        out |= {p + "attn_norm.weight": TensorSpec((d,)), p + "ffn_norm.weight": TensorSpec((d,))}
        for which in ("attn", "ffn"):
            out |= {p + f"hc_{which}_fn": TensorSpec((mix, hc * d)), p + f"hc_{which}_scale": TensorSpec((3,)),
                    p + f"hc_{which}_base": TensorSpec((mix,))}
        out[p + "ffn.gate.weight"] = TensorSpec((m.n_routed_experts, d))
        if i < m.num_hash_layers:
            out[p + "ffn.gate.tid2eid"] = TensorSpec((v, m.num_experts_per_tok), "int")
        else:
            out[p + "ffn.gate.bias"] = TensorSpec((m.n_routed_experts,))
        for e in range(m.n_routed_experts):
            q = f"{p}ffn.experts.{e}."
            out |= {q + "w1.weight": TensorSpec((inter, d)), q + "w2.weight": TensorSpec((d, inter)),
                    q + "w3.weight": TensorSpec((inter, d))}
        if shared:
            q = p + "ffn.shared_experts."
            out |= {q + "w1.weight": TensorSpec((shared, d)), q + "w2.weight": TensorSpec((d, shared)),
                    q + "w3.weight": TensorSpec((shared, d))}
    out |= {"norm.weight": TensorSpec((d,)), "head.weight": TensorSpec((v, d)),
            "hc_head_fn": TensorSpec((hc, hc * d)), "hc_head_scale": TensorSpec((1,)),
            "hc_head_base": TensorSpec((hc,))}
    return out


# ---------------------------------------------------------------------------------------------- errors
class WeightsError(ABIError):
    """Weights that cannot serve a config: every issue (``issues``, as :class:`ABIError`) plus a one-line
    :meth:`summary` (counts and the first few names) for a checkpoint that is wholly wrong.

    ``unreadable`` names files that could not be opened; ``unused`` lists checkpoint tensors the model does not
    read (ignored, but telling when the required ones are missing: another model's or converter's names).
    """

    #: Names quoted per category in :meth:`summary`.
    EXAMPLES = 3

    def __init__(self, issues: Iterable[Issue], *, config_name: str, required: int,
                 unused: Iterable[str] = (), unreadable: Iterable[str] = ()):
        super().__init__(issues)
        self.config_name, self.required = config_name, required
        self.unused, self.unreadable = tuple(unused), tuple(unreadable)

    def __reduce__(self) -> tuple[Any, ...]:  # survives a process boundary (a rank or kernel process)
        return _weights_error, (self.issues, self.config_name, self.required, self.unused, self.unreadable)

    def by_code(self, code: str) -> list[Issue]:
        return [i for i in self.issues if i.code == code]

    def summary(self) -> str:
        """One line, e.g. '170 of 170 tensors tiny needs are missing (embed.weight, ...); the checkpoint holds
        12 tensors tiny does not read (model.embed.weight, ...)'."""
        if self.unreadable:
            return "; ".join(f"{i.field}: {i.message}" if i.field in self.unreadable else i.message
                             for i in self.issues)
        n, parts = self.EXAMPLES, []
        missing, shape, dtype = self.by_code("array.missing"), self.by_code("array.shape"), self.by_code("array.dtype")
        if missing:
            parts.append(f"{len(missing)} of {self.required} tensors {self.config_name} needs are missing "
                         f"({_examples([i.field for i in missing], n)})")
        if shape:
            first = shape[0]
            parts.append(f"{len(shape)} have the wrong shape ({first.field}: expected {first.expected}, got "
                         f"{first.actual}{', ...' if len(shape) > 1 else ''})")
        if dtype:
            parts.append(f"{len(dtype)} have an unsupported dtype ({dtype[0].field}: {dtype[0].actual}; "
                         "in-memory weights are floats; load FP8/FP4 checkpoints with from_safetensors)")
        others = [i for i in self.issues if i.code not in ("array.missing", "array.shape", "array.dtype")]
        parts += [str(i) for i in others[:1]]
        text = ", ".join(parts) if parts else "weights are invalid"
        if missing and self.unused:
            text += (f"; the checkpoint holds {len(self.unused)} tensors {self.config_name} does not read "
                     f"({_examples(self.unused, n)})")
        return text


def _weights_error(issues: tuple[Issue, ...], config_name: str, required: int, unused: tuple[str, ...],
                   unreadable: tuple[str, ...]) -> WeightsError:
    return WeightsError(issues, config_name=config_name, required=required, unused=unused, unreadable=unreadable)


def _examples(names: Iterable[str], n: int) -> str:
    names = list(names)
    return ", ".join(names[:n]) + (", ..." if len(names) > n else "")

"""Mixture-of-experts: DeepSeek's router and the routed experts, split across TP ranks.

Routing (DeepSeek-V3 report, arXiv:2412.19437, section 2.1.2): sigmoid affinities per
expert; a bias (`e_score_correction_bias`, learned for load balance) shifts them for the
choice only; experts come in `n_group` groups, each group scored by the sum of its two
best biased affinities, and only the `topk_group` best groups may be picked from; the
top `num_experts_per_tok` experts by biased affinity are chosen and weighted by their
unbiased affinities, normalised to sum to 1 when `norm_topk_prob`, times
`routed_scaling_factor`.

The experts' weights are stacked: `w13` [E, 2 * I, hidden] (gate then up) and `w2`
[E, hidden, I]. Under tensor parallelism every rank holds every expert's slice of the
intermediate dimension I (as a dense MLP is split), so each rank's output is a partial
sum, all-reduced once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_reduce
from minivllm.kernels.registry import Kernels
from minivllm.layers.custom_op import CustomOp
from minivllm.layers.linear import divide
from minivllm.layers.panel_linear import PANEL, exactly_bf16, pack_panels
from minivllm.utils.memory import own_mapping_empty


def grouped_topk(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    num_groups: int,
    topk_group: int,
    renormalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] float32, expert ids [T, top_k]) from float32 router logits [T, E]."""
    scores = router_logits.sigmoid()
    choice = scores + correction_bias if correction_bias is not None else scores
    num_tokens, num_experts = choice.shape
    if num_groups > 1:
        grouped = choice.view(num_tokens, num_groups, num_experts // num_groups)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        best_groups = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, best_groups, 1).bool()
        expert_mask = group_mask.repeat_interleave(num_experts // num_groups, dim=1)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def moe_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Each token through its chosen experts (SiLU-gated), weighted and summed: the plain
    PyTorch path, one pass per expert that any token chose."""
    return routed_experts(
        x, weights, ids, lambda e, rows: F.linear(rows, w13[e]), lambda e, h: F.linear(h, w2[e])
    )


def routed_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    up: Callable[[int, torch.Tensor], torch.Tensor],
    down: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The routing loop with each expert's two products given: `up(e, rows)` is expert e's
    gate and up projections (gate first), `down(e, h)` its down projection. Quantized
    experts (`quantization/moe_method.py`) pass their own ops here."""
    out = torch.zeros_like(x)
    for expert in ids.unique().tolist():
        token_idx, slot = torch.where(ids == expert)
        gate, up_half = up(expert, x[token_idx]).chunk(2, dim=-1)
        h = down(expert, F.silu(gate) * up_half)
        # a token picks an expert at most once: plain indexed adds (index_add_ is far
        # slower on CPU), in the same order of experts as transformers'
        out[token_idx] += (h * weights[token_idx, slot, None]).to(out.dtype)
    return out


class GroupedTopKRouter(CustomOp):
    """DeepSeek's router: a float32 projection to expert affinities and the group-limited
    choice above. Returns (weights [T, top_k] float32, expert ids [T, top_k]). With the
    CPU kernels the choice is one call (`kernels/moe_routing.cpp`): ~0.3 ms of PyTorch
    ops per MoE layer per decode step before it (AMD EPYC Zen 1)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        num_groups: int = 1,
        topk_group: int = 1,
        renormalize: bool = True,
        routed_scaling_factor: float = 1.0,
        correction_bias: bool = True,
    ) -> None:
        super().__init__()
        if num_experts % num_groups:
            raise ValueError(f"n_group={num_groups} does not divide {num_experts} experts")
        if not 1 <= topk_group <= num_groups:
            raise ValueError(f"topk_group={topk_group} must be in [1, n_group={num_groups}]")
        if num_groups > 1 and num_experts // num_groups < 2:
            raise ValueError("group-limited routing scores each group by its best two experts")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, {num_experts}]")
        if top_k > topk_group * (num_experts // num_groups):
            raise ValueError(
                f"num_experts_per_tok={top_k} is more than the {topk_group} allowed groups "
                f"(topk_group) hold: {topk_group * (num_experts // num_groups)} experts"
            )
        self.topk_op: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        self.top_k, self.num_groups, self.topk_group = top_k, num_groups, topk_group
        self.renormalize, self.routed_scaling_factor = renormalize, routed_scaling_factor
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False
        )
        self.e_score_correction_bias = None
        if correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(num_experts, dtype=torch.float32), requires_grad=False
            )

    def select_kernels(self, kernels: Kernels) -> None:
        self.topk_op = kernels.op("moe_grouped_topk")

    @property
    def uses_kernels(self) -> bool:
        return self.topk_op is not None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight)
        topk = self.topk_op if self.topk_op is not None and logits.is_cpu else grouped_topk
        return topk(
            logits,
            self.e_score_correction_bias,
            self.top_k,
            self.num_groups,
            self.topk_group,
            self.renormalize,
            self.routed_scaling_factor,
        )


class FusedMoE(CustomOp):
    """The routed experts, stacked; returns the routed output of a token batch (all-reduced).
    On bf16 CPUs with the kernels, one call (`kernels/moe.cpp`) reads each chosen expert's
    weights once for all the tokens that chose it. In fp32 engines on the AVX2 kernels, a
    bf16 checkpoint's experts are held as bf16 panels, as its linears are
    (`layers/panel_linear.py`), and run in one call (`kernels/avx2_moe.cpp`): half the
    memory and bytes per step of float32 experts, the same values."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.moe_op: Callable[..., torch.Tensor] | None = None
        # avx2_moe.cpp's moe_bf16w where w13/w2 hold bf16 panels [E, panels, K, 16]
        self.panels_op: Callable[..., torch.Tensor] | None = None
        # a quantized experts method (`quantization/moe_method.py`), or None: w13 and w2
        # in the model's dtype
        self.quant_method = None
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.intermediate = divide(intermediate_size, self.tp_size)
        # on the CPU each stack on a mapping of its own: quantizing the experts (as soon as
        # the checkpoint filled them, loader/streamed_quantization.py) or repacking them
        # hands the pages straight back (utils/memory.own_mapping_empty)
        self.dtype = torch.get_default_dtype()  # the checkpoint's experts are cast to it
        self.w13 = nn.Parameter(
            own_mapping_empty((num_experts, 2 * self.intermediate, hidden_size), self.dtype),
            requires_grad=False,
        )
        self.w2 = nn.Parameter(
            own_mapping_empty((num_experts, hidden_size, self.intermediate), self.dtype),
            requires_grad=False,
        )

    def load_expert_weight(self, expert: int, proj: str, loaded: torch.Tensor) -> None:
        """One expert's `gate_proj`, `up_proj` or `down_proj` weight, this rank's slice of it."""
        size, start = self.intermediate, self.tp_rank * self.intermediate
        if proj == "down_proj":
            dst, src = self.w2.data[expert], loaded.narrow(1, start, size)
        else:
            offset = 0 if proj == "gate_proj" else size
            dst, src = self.w13.data[expert, offset : offset + size], loaded.narrow(0, start, size)
        if dst.shape != src.shape:
            raise ValueError(
                f"expert {expert} {proj} has shape {tuple(loaded.shape)}, which does not fit "
                f"{self.num_experts} experts of intermediate size {size * self.tp_size}"
            )
        dst.copy_(src)

    def process_weights_after_loading(self, kernels: Kernels) -> None:
        """Unquantized experts in an fp32 engine on the AVX2 kernels, whose values are all
        bf16 (a bf16 checkpoint's): repacked as bf16 panels, one expert at a time. A
        weight-cache daemon exports the panels, and a mapped engine finds them as they are."""
        op = kernels.op("moe_bf16w")
        if op is None or self.quant_method is not None:
            return
        if self.w13.dim() == 4:  # mapped from a daemon that packed them
            self.panels_op = op
            return
        if self.w13.dtype != torch.float32 or not all(
            exactly_bf16(w) for w in (*self.w13.data, *self.w2.data)
        ):
            return
        packed = {}
        for name in ("w13", "w2"):
            stacked = getattr(self, name).data
            e, n, k = stacked.shape
            packed[name] = torch.empty(e, -(-n // PANEL), k, PANEL, dtype=torch.bfloat16)
            for expert in range(e):
                packed[name][expert] = pack_panels(stacked[expert])
        # both or neither (a failure above leaves the float32 experts as they were)
        for name, panels in packed.items():
            self.register_parameter(name, nn.Parameter(panels, requires_grad=False))
        self.panels_op = op

    def select_kernels(self, kernels: Kernels) -> None:
        self.moe_op = kernels.op("moe_experts")

    @property
    def uses_kernels(self) -> bool:
        return self.moe_op is not None or self.panels_op is not None

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            out = self.quant_method.apply(self, x, weights, ids)
        elif self.panels_op is not None:
            rows = x.float().contiguous()
            out = self.panels_op(rows, weights, ids, self.w13, 2 * self.intermediate, self.w2)
            out = out.to(x.dtype)
        elif self.moe_op is not None and x.dtype == torch.bfloat16:
            out = self.moe_op(x.contiguous(), self.w13, self.w2, weights, ids)
        else:
            out = moe_reference(x, self.w13, self.w2, weights, ids)
        return tp_all_reduce(out)

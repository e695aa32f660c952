"""evoesap.scoring.importance: the observer pass against an all-experts reference written here, and orders."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch
from transformers.activations import ACT2FN

from evoesap import moe
from evoesap.data import TokenizedSample, batches
from evoesap.errors import ConfigError
from evoesap.scoring import importance

FAMILIES = {
    "olmoe": {},
    "qwen3_moe": {"norm_topk_prob": True},
    "mixtral": {},
    "deepseek_v3": {},
    "gpt_oss": {},
    "qwen3_next": {},
    "qwen3_5_moe_text": {},
    "kimi_linear": {},
    "minimax": {},
    "granitemoehybrid": {},
    "jamba": {},
    "llama4_text": {},
    "lfm2_moe": {},
    "qwen3_5_moe": {},
    "qwen3_vl_moe": {},
    "glm4v_moe": {},
}


def _samples(vocab: int, seed: int = 0, n: int = 7) -> list[TokenizedSample]:
    """Random token sequences of uneven lengths, so batches carry right padding."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(3, 17))
        out.append(TokenizedSample(i, rng.integers(0, vocab, length).tolist(), [True] * length))
    return out


def _moe_blocks(model: torch.nn.Module) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    """(router, experts) of every MoE block, in model order, found by the modules' own attributes."""
    found = []
    for module in model.modules():
        experts = getattr(module, "experts", None)
        router = getattr(module, "router", None) or getattr(module, "gate", None)
        if isinstance(experts, torch.nn.Module) and hasattr(experts, "gate_up_proj") and router is not None:
            found.append((router, experts))
    return found


def _all_expert_outputs(model: torch.nn.Module, experts: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token from the fused weights, in float64: [T, E, H]."""
    x = x.double()
    gate_up, down = experts.gate_up_proj.double(), experts.down_proj.double()
    if model.config.model_type == "gpt_oss":  # [E,H,2I] interleaved gate/up, [E,I,H], biases, clamped GLU
        h = torch.einsum("th,eho->teo", x, gate_up) + experts.gate_up_proj_bias.double()
        gate, up = h[..., ::2], h[..., 1::2]
        limit, alpha = model.config.swiglu_limit, model.config.swiglu_alpha
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        act = (up + 1) * gate * torch.sigmoid(gate * alpha)
        return torch.einsum("tei,eih->teh", act, down) + experts.down_proj_bias.double()
    if model.config.model_type == "llama4_text":  # [E,H,2I] gate columns first, then up; [E,I,H]
        h = torch.einsum("th,eho->teo", x, gate_up)
        inter = h.shape[-1] // 2
        act = ACT2FN[model.config.hidden_act](h[..., :inter]) * h[..., inter:]
        return torch.einsum("tei,eih->teh", act, down)
    h = torch.einsum("th,eoh->teo", x, gate_up)  # [T, E, 2I]: gate rows first, then up
    inter = h.shape[-1] // 2
    activation = getattr(model.config.get_text_config(), "hidden_act", "silu")  # LFM2-MoE: silu, no field
    act = ACT2FN[activation](h[..., :inter]) * h[..., inter:]
    return torch.einsum("tei,ehi->teh", act, down)


def _reference(model: torch.nn.Module, tokenized: list[TokenizedSample], batch_size: int) -> pd.DataFrame:
    """Straightforward scores: the router's own outputs (hooked) select from all experts' outputs."""
    blocks = _moe_blocks(model)
    seen: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def hook(layer):
        def record(module, args, output):
            x = args[0].reshape(-1, args[0].shape[-1])  # [T, H]
            if len(output) == 2:  # Llama 4: (dense weights, logits); the sigmoid of each top-k logit weights its input
                values, index = output[1].topk(module.top_k, dim=-1)
                seen.append((layer, x, torch.sigmoid(values.float()), index))
                return
            seen.append((layer, x, output[1].detach(), output[2].detach()))

        return record

    handles = [router.register_forward_hook(hook(i)) for i, (router, _) in enumerate(blocks)]
    n_exp = [experts.gate_up_proj.shape[0] for _, experts in blocks]
    freq = [np.zeros(e) for e in n_exp]
    seer, ean, gated = ([np.zeros(e) for e in n_exp] for _ in range(3))
    tokens = [0] * len(blocks)
    try:
        with torch.no_grad():
            for batch in batches(tokenized, batch_size, pad_id=0):
                seen.clear()
                model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
                real = batch.attention_mask.reshape(-1).bool().numpy()
                for layer, x, weights, index in seen:
                    outs = _all_expert_outputs(model, blocks[layer][1], x)  # [T, E, H]
                    norms = outs.norm(dim=-1).numpy()  # [T, E]
                    w, idx = weights.double().numpy(), index.numpy()
                    tokens[layer] += int(real.sum())
                    for t in np.flatnonzero(real):
                        for j in range(idx.shape[1]):
                            e = idx[t, j]
                            freq[layer][e] += 1
                            seer[layer][e] += w[t, j]
                            ean[layer][e] += norms[t, e]
                            gated[layer][e] += w[t, j] * norms[t, e]
    finally:
        for h in handles:
            h.remove()
    rows = []
    for layer in range(len(blocks)):
        for e in range(n_exp[layer]):
            reap = gated[layer][e] / freq[layer][e] if freq[layer][e] else 0.0
            rows.append((layer, e, freq[layer][e], seer[layer][e], ean[layer][e], reap, tokens[layer]))
    return pd.DataFrame(rows, columns=list(importance.COLUMNS))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_scores_match_all_experts_reference(family):
    model = moe.tiny_model(family, seed=0, **FAMILIES[family]).eval()
    tokenized = _samples(model.config.get_text_config().vocab_size)
    got = importance.observe(model, tokenized, batch_size=3)
    want = _reference(model, tokenized, batch_size=3)
    assert list(got.columns) == list(importance.COLUMNS)
    assert len(got) == len(want) and got["layer"].nunique() == len(_moe_blocks(model))
    np.testing.assert_array_equal(
        got[["layer", "expert", "frequency", "tokens"]].to_numpy(), want[["layer", "expert", "frequency", "tokens"]].to_numpy()
    )
    for col in ("seer", "ean", "reap"):
        np.testing.assert_allclose(got[col].to_numpy(), want[col].to_numpy(), rtol=1e-5, atol=0, err_msg=f"{family} {col}")


@pytest.mark.parametrize("family", ["olmoe", "gpt_oss"])
def test_frequency_sums_to_tokens_times_top_k(family):
    model = moe.tiny_model(family, seed=1).eval()
    tokenized = _samples(model.config.get_text_config().vocab_size, seed=2)
    scores = importance.observe(model, tokenized, batch_size=4)
    real_tokens = sum(len(s.input_ids) for s in tokenized)  # padding excluded
    for layer, top_k in enumerate(moe.inspect(model).top_k):
        rows = scores[scores["layer"] == layer]
        assert (rows["tokens"] == real_tokens).all()
        assert rows["frequency"].sum() == real_tokens * top_k


def test_unreached_expert_has_zero_reap():
    model = moe.tiny_model("gpt_oss", seed=0).eval()
    router, _ = _moe_blocks(model)[0]
    with torch.no_grad():
        router.bias[3] = -1e4  # GPT-OSS takes top-k on the biased logits: expert 3 is never chosen
    scores = importance.observe(model, _samples(model.config.get_text_config().vocab_size), batch_size=2)
    row = scores[(scores["layer"] == 0) & (scores["expert"] == 3)].iloc[0]
    assert row["frequency"] == 0 and row["seer"] == 0 and row["ean"] == 0 and row["reap"] == 0
    assert scores["reap"].notna().all()


def test_pruning_order_ascending_with_ties_by_expert_id():
    scores = pd.DataFrame(
        {
            "layer": [0, 0, 0, 0, 1, 1, 1, 1],
            "expert": [3, 2, 1, 0, 0, 1, 2, 3],
            "frequency": [5, 1, 5, 0, 2, 2, 2, 1],
            "seer": [0.1, 0.4, 0.3, 0.2, 1.0, 0.5, 0.5, 0.0],
            "ean": [1.0] * 8,
            "reap": [0.0] * 8,
            "tokens": [10] * 8,
        }
    )
    assert importance.pruning_order(scores, "frequency") == [[0, 2, 1, 3], [3, 0, 1, 2]]
    assert importance.pruning_order(pa.Table.from_pandas(scores), "seer") == [[3, 0, 1, 2], [3, 1, 2, 0]]
    assert importance.pruning_order(scores, "ean") == [[0, 1, 2, 3], [0, 1, 2, 3]]
    with pytest.raises(ConfigError, match="unknown criterion 'gini'"):
        importance.pruning_order(scores, "gini")


def test_calibrate_stage_and_cli_write_scores(tmp_path):
    import json

    from evoesap.cli import main
    from evoesap.demo.tokenizer import build_tokenizer
    from evoesap.stages.calibrate import CalibrateParams, run_calibrate

    tok = build_tokenizer()
    model = moe.tiny_model("olmoe", seed=0, vocab_size=len(tok)).eval()
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    rows = [
        {"messages": [{"role": "user", "content": f"what is {i}+{i}?"}, {"role": "assistant", "content": f"{2 * i}."}]}
        for i in range(12)
    ]
    (tmp_path / "cal.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    params = CalibrateParams(samples=5, max_length=64, batch_size=2, seed=3, model_dtype="float32", device="cpu")

    manifest = run_calibrate(str(tmp_path / "model"), str(tmp_path / "cal.jsonl"), params, str(tmp_path / "cal"))
    assert manifest.stage == "calibrate" and set(manifest.files) == {"scores.parquet"}
    got = importance.read_scores(str(tmp_path / "cal"))
    from evoesap.data import load_samples, tokenize_samples

    samples = load_samples(str(tmp_path / "cal.jsonl"), n=5, seed=3)
    want = importance.observe(model, tokenize_samples(samples, tok, max_length=64), 2, pad_id=tok.pad_token_id)
    pd.testing.assert_frame_equal(got, want, rtol=1e-6)

    assert (
        main(
            [
                "calibrate",
                "--model",
                str(tmp_path / "model"),
                "--data",
                str(tmp_path / "cal.jsonl"),
                "--out",
                str(tmp_path / "cli"),
                "--samples",
                "5",
                "--max-length",
                "64",
                "--batch-size",
                "2",
                "--seed",
                "3",
                "--model-dtype",
                "float32",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    pd.testing.assert_frame_equal(importance.read_scores(str(tmp_path / "cli")), got)
    assert (
        main(["calibrate", "--model", "m", "--data", "d.jsonl", "--out", str(tmp_path / "x"), "--batch-size", "0"]) == 2
    )  # out of the declared range: a usage error


def test_calibrate_params_validated_before_any_loading():
    from evoesap.stages.calibrate import CalibrateParams

    with pytest.raises(ConfigError, match="batch_size must be >= 1, got 0"):
        CalibrateParams(batch_size=0)
    with pytest.raises(ConfigError, match="model_dtype 'int8'"):
        CalibrateParams(model_dtype="int8")
    assert CalibrateParams(samples=64.0).samples == 64  # pipeline configs may deliver ints as floats
    with pytest.raises(ConfigError, match="prompt and response"):
        CalibrateParams(prompt_field="q")

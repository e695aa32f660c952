"""The concept pages' figures, drawn from the library's own maths -> docs/images/concepts/*.svg.

    python docs/concept_figures.py --out docs/images/concepts

Each figure computes what it shows: the criteria from one synthetic layer's routing with the formulas of
`evoesap.scoring.importance`, the allocations with `evoesap.method.allocation`, ESAP with
`evoesap.scoring.metrics.esap`, the level-switch move as `evoesap.method.search` makes it, and the masked routing
against the pruned router's. The SVGs carry no date and a fixed hash salt, so an unchanged figure is byte-identical.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from evoesap.method import allocation  # noqa: E402

plt.rcParams.update({"svg.hashsalt": "evoesap-concepts", "svg.fonttype": "none", "font.size": 10, "axes.spines.top": False,
                     "axes.spines.right": False})  # fmt: skip
FULL, KEPT, REMOVED, ACCENT = "#5b6770", "#3f7fbf", "#d9d9d9", "#e3a21a"


def save(fig: plt.Figure, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    print(path)


def routing(tokens: int = 4000, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One synthetic MoE layer of 8 experts, top-2 of a softmax over all experts (OLMoE's maths): the router's
    probabilities [T, E], the chosen experts [T, k] and the experts' output norms ||f_i(x)||_2 [T, E]."""
    rng = np.random.default_rng(seed)
    bias = np.array([0.6, 0.2, -0.4, 0.9, 0.0, -0.8, 0.4, -0.1])  # how much the router prefers each expert
    spread = np.array([1.6, 0.5, 1.0, 0.4, 1.3, 0.9, 0.6, 1.0])  # how much that varies from token to token
    scale = np.array([2.4, 0.6, 1.8, 0.9, 0.5, 1.6, 0.7, 1.1])  # how large each expert's output is
    logits = rng.normal(size=(tokens, len(bias))) * spread + bias  # [T, E]
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)  # [T, E]
    chosen = np.argsort(-probs, axis=1, kind="stable")[:, :2]  # [T, k]
    norms = rng.gamma(4.0, scale / 4.0, size=(tokens, len(bias)))  # [T, E]
    return probs, chosen, norms


def criteria_figure(out: Path) -> None:
    probs, chosen, norms = routing()
    tokens, experts = probs.shape
    routed = np.zeros_like(probs, dtype=bool)
    routed[np.arange(tokens)[:, None], chosen] = True  # A_i as a [T, E] mask
    gates = np.where(routed, probs, 0.0)
    count = routed.sum(axis=0)
    scores = {
        "Frequency": count.astype(float),
        "SEER": gates.sum(axis=0),
        "EAN": np.where(routed, norms, 0.0).sum(axis=0),
        "REAP": np.where(count > 0, (gates * norms).sum(axis=0) / np.maximum(count, 1), 0.0),
    }
    fig, axes = plt.subplots(2, 2, figsize=(7.5, 4.8), sharex=True)
    for ax, (name, values) in zip(axes.flat, scores.items()):
        order = np.argsort(values, kind="stable")  # ascending: the first r go first
        colours = [REMOVED if e in order[:2] else KEPT for e in range(experts)]
        ax.bar(range(experts), values / values.max(), color=colours)
        ax.set_title(f"{name}: order {' '.join(map(str, order))}", fontsize=10)
        ax.set_xticks(range(experts))
    for ax in axes[1]:
        ax.set_xlabel("expert")
    for ax in axes[:, 0]:
        ax.set_ylabel("score / max")
    fig.suptitle("One layer, 8 experts, top-2: grey = the 2 experts each criterion removes first", fontsize=10)
    fig.tight_layout()
    save(fig, out / "criteria.svg")


def allocation_figure(out: Path) -> None:
    n, k = [16] * 8, [2] * 8
    budget = allocation.budget(0.25, n, k)
    shown = {"uniform": allocation.uniform(n, k, budget), "searched (example)": (1, 2, 3, 6, 7, 5, 4, 4)}
    fig, axes = plt.subplots(1, 2, figsize=(8.5, 3), sharey=True)
    for ax, (name, r) in zip(axes, shown.items()):
        allocation.check(r, n, k, budget)
        kept = [n_l - r_l for n_l, r_l in zip(n, r)]
        ax.bar(range(len(n)), kept, color=KEPT, label="kept")
        ax.bar(range(len(n)), r, bottom=kept, color=REMOVED, label="removed")
        ax.axhline(k[0], color=ACCENT, lw=1, ls="--", label="top-k: always kept")
        ax.set_title(f"{name}: r = {tuple(r)}, sum = {sum(r)}", fontsize=9)
        ax.set_xlabel("MoE layer")
        ax.set_xticks(range(len(n)))
    axes[0].set_ylabel("experts")
    axes[1].legend(loc="upper right", fontsize=8, frameon=False)
    fig.suptitle(f"8 layers of 16 experts, top-2, sparsity 25%: budget B = {budget}", fontsize=10)
    fig.tight_layout()
    save(fig, out / "allocation.svg")


def esap_figure(out: Path) -> None:
    import torch

    from evoesap.scoring.metrics import esap

    vocab = np.arange(12)
    p = np.exp(-0.5 * ((vocab - 4.0) / 1.6) ** 2)
    q = np.exp(-0.5 * ((vocab - 5.5) / 2.0) ** 2)
    p, q = p / p.sum(), q / q.sum()
    value = float(esap(torch.tensor(np.log(p))[None], torch.tensor(np.log(q))[None])[0])
    tv = 0.5 * np.abs(p - q).sum()
    fig, ax = plt.subplots(figsize=(7, 2.8))
    ax.bar(vocab, np.minimum(p, q), width=0.8, color=ACCENT, label="min(p, q): accepted mass")
    ax.step(vocab, p, where="mid", color=FULL, lw=1.6, label="p: full model")
    ax.step(vocab, q, where="mid", color=KEPT, lw=1.6, label="q: pruned candidate")
    ax.set_xticks(vocab)
    ax.set_xlabel("token v")
    ax.set_ylabel("probability")
    ax.set_title(f"ESAP(x) = sum of min(p, q) = {value:.3f} = 1 - TV(p, q) = 1 - {tv:.3f}", fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    save(fig, out / "esap.svg")


def search_figure(out: Path) -> None:
    n, k = [16] * 6, [2] * 6
    parent = (4, 4, 4, 4, 4, 4)
    a, b, delta = 1, 4, 3  # one level-switch step: layer a removes delta more, layer b delta fewer
    child = list(parent)
    child[a] += delta
    child[b] -= delta
    allocation.check(child, n, k, sum(parent))
    fig, axes = plt.subplots(1, 2, figsize=(8, 2.8), sharey=True)
    for ax, (name, r) in zip(axes, (("elite r", parent), (f"offspring r' (a = {a}, b = {b}, Δ = {delta})", child))):
        colours = [ACCENT if name != "elite r" and layer in (a, b) else REMOVED for layer in range(len(r))]
        ax.bar(range(len(r)), r, color=colours)
        ax.set_title(f"{name}: sum = {sum(r)}", fontsize=9)
        ax.set_xlabel("MoE layer")
        ax.set_xticks(range(len(r)))
    axes[0].set_ylabel("experts removed r_l")
    fig.suptitle("A level-switch moves Δ removals between two layers; the budget stays the same", fontsize=10)
    fig.tight_layout()
    save(fig, out / "search.svg")


def masking_figure(out: Path) -> None:
    logits = np.array([1.2, -0.3, 2.1, 0.4, 1.9, -1.0, 0.8, 1.5])  # one token's router logits z, 8 experts
    removed = {2, 5}  # the pruned set: expert 2 would have been chosen
    masked = np.array([-np.inf if e in removed else z for e, z in enumerate(logits)])
    kept = [e for e in range(len(logits)) if e not in removed]

    def top2(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        probs = np.exp(z - z.max()) / np.exp(z - z.max()).sum()  # softmax over all experts, then top-k
        chosen = np.argsort(-probs, kind="stable")[:2]
        return chosen, probs

    chosen_masked, probs_masked = top2(masked)
    chosen_pruned, probs_pruned = top2(logits[kept])
    assert [kept[i] for i in chosen_pruned] == list(chosen_masked)
    assert np.allclose(probs_pruned[chosen_pruned], probs_masked[chosen_masked])
    fig, axes = plt.subplots(1, 2, figsize=(8.5, 3))
    colours = [REMOVED if e in removed else ACCENT if e in chosen_masked else KEPT for e in range(len(logits))]
    axes[0].bar(range(len(logits)), probs_masked, color=colours)
    axes[0].set_title("full model, logits of removed experts set to -inf", fontsize=9)
    axes[0].set_xticks(range(len(logits)))
    axes[1].bar(range(len(kept)), probs_pruned, color=[ACCENT if i in chosen_pruned else KEPT for i in range(len(kept))])
    axes[1].set_title("pruned checkpoint's router (experts 2 and 5 gone)", fontsize=9)
    axes[1].set_xticks(range(len(kept)), [str(e) for e in kept])
    for ax in axes:
        ax.set_xlabel("expert (original id)")
    axes[0].set_ylabel("router probability")
    fig.suptitle("The same top-2 experts and the same weights: masking scores what removal would give", fontsize=10)
    fig.tight_layout()
    save(fig, out / "masking.svg")


FIGURES = (criteria_figure, allocation_figure, esap_figure, search_figure, masking_figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "images" / "concepts")
    args = parser.parse_args()
    for figure in FIGURES:
        figure(args.out)


if __name__ == "__main__":
    main()

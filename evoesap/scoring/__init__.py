"""Candidate scoring: how one pruning allocation becomes a fitness, in the order it happens.

1. `teacher`: the teacher cache (the full model's log-probabilities at scored positions), written once
   by cache-logits and loaded or streamed batch by batch during a search.
2. `forward`: the candidate's forward: cached samples batched and right-padded, the decoder stack run
   half-layer by half-layer, the LM head at the scored rows.
3. `prefix`: hidden states at MoE-layer boundaries kept under a byte budget, where a later candidate's
   forward may start.
4. `metrics`: ESAP, SAP, KL and NLL per scored position, and the per-sample and dataset means.
5. `evaluator`: `CandidateEvaluator`, which ties them together (memoised per allocation and sample).

Beside them, `importance` scores the experts themselves (one observer pass, the four criteria, the per-layer
pruning orders) with the same forward.

Nothing is imported here, so that reading a cache (`teacher`) never loads the evaluator's dependencies.
"""

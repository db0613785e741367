"""trace-jax: TRACE (rollout-guided FP4 QAT for RL of MoE language models) in JAX and Pallas.

Data flow, one package each: `fp4` (numerics) -> `models` -> `rollout` -> `guidance` (store) ->
`rl` (trainer).
"""

"""`rlvr serve`: the policy behind an OpenAI-compatible API, every exchange recorded token-exactly.

app.py          FastAPI app: /v1/models, /v1/chat/completions (tools, logprobs)
completions.py  /v1/completions on token ids (vLLM's protocol) and weight-sync endpoints
recorder.py     trajectories per client rollout id, token for token
state.py        what the endpoints share: model, tokenizer, generator, lock, recorder
"""

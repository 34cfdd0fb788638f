"""`rlvr serve`: the policy behind an OpenAI-compatible API, every exchange recorded token-exactly.

app.py          FastAPI app: /v1/models, /v1/chat/completions (tools, logprobs, streaming)
completions.py  /v1/completions on token ids (vLLM's protocol) and weight-sync endpoints
auth.py         the API key on every endpoint; admin (weight-changing) endpoints only with it
shared.py       client errors, the training endpoint's limits, seeded sampling, top log-probs
batcher.py      concurrent chat requests sampled in one generate call
recorder.py     trajectories per client rollout id, token for token
external.py     `rollout: external`: the user's agent plays through the endpoint, rlvr trains
runner.py       uvicorn in a thread; the serve state over a loaded policy
state.py        what the endpoints share: model, tokenizer, generator, lock, recorder
"""

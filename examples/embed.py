from connectors import build_connector
from engine import LLM, SamplingParams
from engine.default_model import default_model_path
from kvstore.config import load_config

config = load_config("configs/default.yaml")  # tiers, policies, connector; KVSTORE_* variables override
connector = build_connector(config)           # embedded: tiers in this process; sidecar: `make run`'s daemon
llm = LLM(default_model_path(), connector=connector)  # SmolLM2-135M-Instruct (or a .gguf file, an HF directory)
plain = LLM(default_model_path())             # the same engine without kvstore, to compare with
for engine in (llm, plain):                   # one-time costs (first kernels, allocations) kept out of the timing
    engine.generate(["warm-up"], SamplingParams(max_tokens=1), cache_salt="warm-up")
notes = "".join(f"Note {i}: service {i} moved to the new cluster and kept its old limits.\n" for i in range(60))
prompt = llm.chat_template.user_prompt(notes + "Question: what is the capital of France?")
greedy = SamplingParams(max_tokens=16, temperature=0.0)
base = plain.generate([prompt], greedy)[0]
first = llm.generate([prompt], greedy, cache_salt="tenant-a")[0]  # computed, and stored in kvstore's tiers
connector.offload("gpu")                      # out of the GPU pool: the next request loads it from a lower tier
again = llm.generate([prompt], greedy, cache_salt="tenant-a")[0]
connector.close()                             # flushes what this run cached, for the next run
print(again.text)
print(f"without kvstore: time to first token {base.metrics.time_to_first_token:.3f} s")
for name, out in (("first", first), ("again", again)):
    print(f"{name}: cached prompt tokens: {out.metrics.cached_tokens_by_tier} of {out.metrics.num_prompt_tokens};",
          f"time to first token {out.metrics.time_to_first_token:.3f} s")

from connectors import build_connector
from engine import LLM, SamplingParams
from engine.default_model import default_model_path
from kvstore.config import load_config

config = load_config("configs/default.yaml")  # tiers, policies, connector; KVSTORE_* variables override
connector = build_connector(config)           # embedded: tiers in this process; sidecar: `make run`'s daemon
llm = LLM(default_model_path(), connector=connector)  # SmolLM2-135M-Instruct (or a .gguf file, an HF directory)
prompt = llm.chat_template.user_prompt("What is the capital of France?")
out = llm.generate([prompt], SamplingParams(max_tokens=16), cache_salt="tenant-a")[0]
connector.close()                             # flushes what this run cached, for the next run
print(out.text)
print("cached prompt tokens:", out.metrics.cached_tokens_by_tier, f"of {out.metrics.num_prompt_tokens};",
      f"time to first token {out.metrics.time_to_first_token:.3f} s")

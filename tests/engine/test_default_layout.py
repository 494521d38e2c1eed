"""The default config's ``model`` section is the layout the engine gives its default model, so a daemon on the
default config (``make run``) serves an engine on the default model with no setting changed."""

from __future__ import annotations

from pathlib import Path

from engine import EngineConfig
from engine.default_model import default_model_path
from engine.gguf_loader import checkpoint_config
from engine.kv_layout import engine_kv_layout
from kvstore.config import KVStoreConfig, ModelConfig, load_config
from kvstore.layout import auto_dtype


def test_default_config_describes_the_default_engine_model(repo: Path) -> None:
    path = default_model_path()
    engine = engine_kv_layout(checkpoint_config(path), EngineConfig(), path)  # what LLM(default_model_path()) uses
    assert (engine.num_layers, engine.num_kv_heads, engine.head_dim, engine.block_size) == (30, 3, 64, 16)
    assert load_config(repo / "configs" / "default.yaml", environ={}).model.layout() == engine
    assert KVStoreConfig().model.layout() == engine
    assert KVStoreConfig().model.layout().fingerprint == engine.fingerprint  # what the daemon's login compares


def test_auto_dtype_is_the_engines_default_dtype() -> None:
    for device in ("cpu", "cuda"):
        assert auto_dtype(device) == EngineConfig(device=device).kv_dtype_name()
    assert ModelConfig().dtype == "auto" and EngineConfig().dtype == "auto"
    assert ModelConfig().kv_dtype() == EngineConfig().kv_dtype_name()  # both resolved on this machine
    assert ModelConfig(dtype="float16").layout().dtype == "float16"  # a named dtype is used as given
    assert ModelConfig().widest_layout().dtype == "float32"  # the frame-size check assumes the largest block

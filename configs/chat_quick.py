"""Chat demo, quick (< 2 min on 2 idle CPU cores): configs/chat.py with 3 turns, 3 questions and
6 output tokens each.

Command:
  python -m experiments.chat --config=configs/chat_quick.py --workdir=/tmp/chat_quick

Expected: as configs/chat.py (identical text with the cache on and off; warm TTFT below
cold once the cached prefix is long), on fewer requests.
"""

from configs import chat


def get_config():
    c = chat.get_config()
    c.max_tokens = 6
    c.token_buckets = (32, 128, 256)  # fewer programs to compile
    c.turns = c.turns[:3]
    c.questions = c.questions[:3]
    return c

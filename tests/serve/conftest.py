import pytest


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from serve_support import TinyTokenizer

    return TinyTokenizer()

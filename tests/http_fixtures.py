"""Fixtures of the tests that drive the OpenAI server over an in-process engine: a tiny
checkpoint with a tokenizer trained here, its AsyncLLM, the server on a loopback port, and an
`openai` client of it. A test module takes them with `from tests.http_fixtures import *`."""
import openai
import pytest

from tests.checkpoints import add_tiny_tokenizer, make_tiny_llama
from tests.http_thread import Server
from tierserve import AsyncLLM

__all__ = ["checkpoint", "engine", "server", "client"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return add_tiny_tokenizer(make_tiny_llama(tmp_path_factory.mktemp("ckpt") / "llama"))


@pytest.fixture(scope="module")
def engine(checkpoint):
    llm = AsyncLLM(str(checkpoint), block_size=4, max_model_len=256)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    # The tests send templates of their own (a server refuses them by default).
    with Server(engine, trust_request_chat_template=True) as srv:
        yield srv


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)

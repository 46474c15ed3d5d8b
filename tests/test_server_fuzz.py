"""Schemathesis against the server's own /openapi.json: no generated request may get a 5xx.

Positive and negative examples for every operation, deterministic, bounded:
a short max_model_len and at most 2 completions per request keep each
example to a few engine steps (a huge max_tokens stops at max_model_len).
"""
import tempfile

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import not_a_server_error

from megatron_composer.inference.engine import Engine
from megatron_composer.inference.server import create_app
from tests.serving import SERVE_CONFIG, build_model, train_small_tokenizer

# The schema is loaded at import (parametrize needs it), so the engine is built here too.
_tmp = tempfile.TemporaryDirectory()
_tokenizer = train_small_tokenizer(f"{_tmp.name}/tok")
_engine = Engine(build_model(), SERVE_CONFIG, _tokenizer, max_batch_size=4, max_model_len=32)
_app = create_app(_engine, model_name="fuzz", max_choices=2)
_config = schemathesis.config.SchemathesisConfig.from_dict(
    {"seed": 0, "generation": {"mode": "all", "deterministic": True}})
schema = schemathesis.openapi.from_asgi("/openapi.json", _app, config=_config)


@pytest.fixture(scope="module", autouse=True)
def _stop_engine():
    yield
    _engine.stop()
    _tmp.cleanup()


@schema.parametrize()
@settings(max_examples=15, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck))
def test_no_request_gets_a_server_error(case):
    case.call_and_validate(checks=[not_a_server_error], timeout=120)

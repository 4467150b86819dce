"""`tierserve api-server`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of an
engine client (an in-process AsyncEngine or a Ray deployment), with Prometheus metrics.

One module per concern: protocol (request bodies -> prompts and SamplingParams), responses (the
fold of output deltas, response and chunk JSON), responses_* (the Responses API: its body, its
output and events, stored responses, the endpoint), anthropic (Anthropic's Messages API),
embeddings, beam (use_beam_search), streaming (a body's engine requests as one stream,
disconnects), admission (body size, the first-token queue bound), errors and handlers
(OpenAI's error JSON), tenants (API keys, tenants' salts and rate limits), metrics
(Prometheus), routes (the app), server_config (its options), reasoning and tool_parsers (what
a reply's text holds besides its answer).
"""
from tierserve.deploy.openai.errors import HTTP_STATUS
from tierserve.deploy.openai.routes import build_app, serve_http
from tierserve.deploy.openai.server_config import ServerConfig
from tierserve.deploy.openai.tenants import KeyTable, TenantLimits

__all__ = ["build_app", "serve_http", "ServerConfig", "HTTP_STATUS", "KeyTable", "TenantLimits"]

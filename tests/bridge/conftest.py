"""The bridge tests run the SDK (clients/python, put first on sys.path by pyproject.toml's
pytest `pythonpath`) against the real service (`gradtape serve`, uvicorn and its workers)."""

from tests.client.conftest import _service_data_dir, server  # noqa: F401 - fixtures

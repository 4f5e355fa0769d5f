"""Fixtures of the deployment tests."""

from tests.service.test_security import pki  # noqa: F401  (a throwaway CA, server and client certificates)

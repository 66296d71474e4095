"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right status."""

from fastapi.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",  # a method the route does not take (its Allow header names those it does)
    408: "invalid_request_error",  # the request did not arrive in time (services/gateway/server.py)
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None, type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after
        self.type = type or _TYPES.get(status, "server_error")  # a rate limit's is the limit: requests | tokens
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = dict(self.headers)
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after)))
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def missing_key(what: str) -> APIError:
    return APIError(401, f"Missing {what} key: send 'Authorization: Bearer <key>'", code="missing_api_key")


def invalid_key(what: str) -> APIError:
    return APIError(401, f"Incorrect {what} key provided", code="invalid_api_key")

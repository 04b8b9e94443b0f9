"""S3's query-string authentication (presigned URLs) for moto_fixture.py's --enforce-auth.

moto 5.2 checks SigV4 only in the Authorization header: a presigned GET (the credential, date, expiry,
signed headers and signature in the query) fails there with a KeyError, answered 500. S3 itself
accepts it when the signature is the one the query's key would make for this request and the URL has
not expired, and refuses it otherwise (403 SignatureDoesNotMatch, AccessDenied "Request has expired").
This does the same, from AWS's "Authenticating Requests: Using Query Parameters (AWS Signature Version
4)": the canonical request with the query (less X-Amz-Signature) sorted and encoded, the signed headers,
and `UNSIGNED-PAYLOAD`; the secret of the access key the query names, as moto keeps it (an IAM user's
key, or an assumed role's with its session token in `X-Amz-Security-Token`).
"""

import datetime
import hashlib
import hmac
import urllib.parse

from moto.iam import access_control
from moto.s3.exceptions import S3ClientError


def _quote(s: str) -> str:
    return urllib.parse.quote(s, safe="-_.~")


def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


class PresignedS3IAMRequest(access_control.S3IAMRequest):
    """An S3 request authenticated by its query string, or by its Authorization header as moto does."""

    def __init__(self, account_id, method, path, data, body, headers, action):
        raw_query = urllib.parse.urlparse(path).query
        query = urllib.parse.parse_qs(raw_query, keep_blank_values=True)
        self._presigned = "X-Amz-Signature" in query and "Authorization" not in headers
        if self._presigned:
            q = {k: v[0] for k, v in query.items()}
            # what the header would have said, so moto finds the key, region and service
            headers = dict(headers)
            headers["Authorization"] = (
                f"AWS4-HMAC-SHA256 Credential={q.get('X-Amz-Credential', '')}, "
                f"SignedHeaders={q.get('X-Amz-SignedHeaders', '')}, Signature={q['X-Amz-Signature']}"
            )
            if "X-Amz-Security-Token" in q:
                headers["X-Amz-Security-Token"] = q["X-Amz-Security-Token"]
            self._query = [(k, v) for k, vs in query.items() for v in vs]
            self._raw_path = urllib.parse.urlparse(path).path
        super().__init__(account_id=account_id, method=method, path=path, data=data, body=body,
                         headers=headers, action=action)

    def check_signature(self) -> None:
        if not self._presigned:
            return super().check_signature()
        q = dict(self._query)
        try:
            date = q["X-Amz-Date"]
            expires = int(q["X-Amz-Expires"])
            signed = q["X-Amz-SignedHeaders"].split(";")
            scope = q["X-Amz-Credential"].split("/", 1)[1]
        except (KeyError, ValueError, IndexError):
            raise S3ClientError("AuthorizationQueryParametersError",
                                "Query-string authentication version 4 requires the X-Amz-Algorithm, "
                                "X-Amz-Credential, X-Amz-Signature, X-Amz-Date, X-Amz-SignedHeaders, "
                                "and X-Amz-Expires parameters.")
        signed_at = datetime.datetime.strptime(date, "%Y%m%dT%H%M%SZ").replace(tzinfo=datetime.timezone.utc)
        if datetime.datetime.now(datetime.timezone.utc) > signed_at + datetime.timedelta(seconds=expires):
            raise S3ClientError("AccessDenied", "Request has expired")
        lower = {k.lower(): v for k, v in self._headers.items()}
        canonical_headers = "".join(f"{h}:{' '.join(lower.get(h, '').split())}\n" for h in signed)
        canonical_query = "&".join(
            f"{_quote(k)}={_quote(v)}" for k, v in sorted(self._query) if k != "X-Amz-Signature")
        canonical = "\n".join([self._method, self._raw_path, canonical_query, canonical_headers,
                               ";".join(signed), "UNSIGNED-PAYLOAD"])
        to_sign = "\n".join(["AWS4-HMAC-SHA256", date, scope,
                             hashlib.sha256(canonical.encode()).hexdigest()])
        secret = self._access_key.create_credentials().secret_key
        key = ("AWS4" + secret).encode()
        for part in scope.split("/"):
            key = _hmac(key, part)
        if hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest() != q["X-Amz-Signature"]:
            self._raise_signature_does_not_match()


def install() -> None:
    """moto's S3 authorization takes presigned URLs from now on."""
    access_control.S3IAMRequest = PresignedS3IAMRequest

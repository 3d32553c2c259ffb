"""Azure's credentials in text that spotckpt prints: connection strings, account keys, SAS."""

from __future__ import annotations

import pytest

from spotckpt.redact import is_secret_key, redact, secret_values

KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
SIG = "fOto%2BzWkBITDvoifTBoy/FNPW4k7le80%3D"


@pytest.mark.parametrize(
    "text",
    [
        f"DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={KEY};EndpointSuffix=x",
        f"connection_string=AccountName=acct;AccountKey={KEY}",
        f"account_key={KEY}",
        f'{{"account_key": "{KEY}"}}',
        f"GET https://acct.blob.core.windows.net/c/b?sv=2024-08-04&se=2026&sp=rw&sig={SIG}&x=1",
        f"sv=2024-08-04&ss=b&srt=co&sp=rwdl&sig={SIG}",
        f"BlobEndpoint=https://a.blob.core.windows.net;SharedAccessSignature=sv=2024&sig={SIG}",
    ],
)
def test_azure_credentials_are_masked(text: str) -> None:
    shown = redact(text)
    assert KEY not in shown and SIG not in shown
    assert "***" in shown


def test_azure_text_around_credentials_is_kept() -> None:
    shown = redact(f"AccountName=acct;AccountKey={KEY};BlobEndpoint=http://h:1/acct")
    assert shown == "AccountName=acct;AccountKey=***;BlobEndpoint=http://h:1/acct"
    assert redact(f"https://a/c/b?sv=1&sig={SIG}&se=2") == "https://a/c/b?sv=1&sig=***&se=2"
    assert redact("design=1 signal=2 assign=3") == "design=1 signal=2 assign=3"


def test_azure_options_count_as_secrets() -> None:
    assert is_secret_key("account_key") and is_secret_key("connection_string")
    assert is_secret_key("sas_token") and not is_secret_key("account_name")
    found = secret_values({"connection_string": f"AccountKey={KEY}", "account_name": "acct"})
    assert found == {f"AccountKey={KEY}"}

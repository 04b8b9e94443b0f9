//! `az://` stores above 32 MiB go through Blob Storage's block uploads (issue 30): object_store's
//! multipart upload for Azure is Put Block per part and Put Block List at the end, which the fake Azure
//! (`tests/aci/aci_cloud.py --blob-only`: its Blob Storage on loopback and the signed-in user's `az`)
//! implements as Azure documents it, refusing what Azure refuses.
//!
//! The store is opened as a user's machine opens it (`src/store.rs`): the account from
//! `AZURE_STORAGE_ACCOUNT_NAME`, the token from the `az` first on PATH. The environment is the
//! process's, so the round trip runs [`child`] in a process of its own (this test binary again).
//!
//! Needs only python3; skipped where it is missing.

use std::path::Path;
use std::process::Command;

use physalia_testkit::{Emulator, Spawn, python};
use serde_json::Value;

/// The dataset's size: 100 MiB, a little over three parts of 32 MiB.
const DATASET_BYTES: usize = 100 << 20;

fn fake() -> Option<Emulator> {
    Spawn::new("tests/aci/aci_cloud.py")
        .args(&["--blob-only"])
        .start()
}

/// What the fake's Blob Storage was asked, in order (`who`, `method`, `path`, `comp`, `bytes`).
fn requests(fake: &Emulator) -> Vec<Value> {
    let url = format!("{}/_fake/requests", blob_root(fake));
    let v = python(&format!(
        "import urllib.request\nprint(urllib.request.urlopen({url:?}).read().decode())"
    ));
    v.as_array().expect("a list of requests").clone()
}

/// `http://127.0.0.1:PORT` of the fake's Blob Storage (its `blob` is `.../<account>`).
fn blob_root(fake: &Emulator) -> String {
    let blob = fake.str("blob");
    blob.rsplit_once('/')
        .expect("http://HOST:PORT/ACCOUNT")
        .0
        .to_string()
}

/// A deterministic file of `n` bytes (xorshift), not compressible and not periodic.
fn write_dataset(path: &Path, n: usize) {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut bytes = Vec::with_capacity(n);
    while bytes.len() < n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        bytes.extend_from_slice(&x.to_le_bytes());
    }
    bytes.truncate(n);
    std::fs::write(path, bytes).unwrap();
}

fn checksum(path: &Path) -> String {
    let out = Command::new("sha256sum").arg(path).output().unwrap();
    assert!(out.status.success(), "sha256sum {}", path.display());
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

/// The round trip, in a process of its own (a no-op unless `PHYSALIA_AZURE_CHILD` is set): opens
/// `PHYSALIA_AZURE_URL` with the process's environment, uploads `PHYSALIA_AZURE_FILE` as a dataset
/// (`Remote::put_file`, as `submit` uploads one), and downloads it beside (`Remote::get_file`, as the
/// coordinator does).
#[test]
fn child() {
    let Some(file) = std::env::var_os("PHYSALIA_AZURE_CHILD") else {
        return;
    };
    let file = Path::new(&file);
    let url = std::env::var("PHYSALIA_AZURE_URL").unwrap();
    let remote = physalia_coordinator::store::Remote::open(&url)
        .unwrap_or_else(|e| panic!("open failed: {e:#}"));
    let name = "0123456789abcdef-big.safetensors";
    remote
        .put_file(".datasets", name, file)
        .unwrap_or_else(|e| panic!("upload failed: {e:#}"));
    println!(
        "size={}",
        remote
            .size(".datasets", name)
            .unwrap_or_else(|e| panic!("{e:#}"))
    );
    let back = file.with_extension("back");
    remote
        .get_file(".datasets", name, &back)
        .unwrap_or_else(|e| panic!("download failed: {e:#}"));
    println!("roundtrip ok");
    if std::env::var_os("PHYSALIA_AZURE_SIGN").is_some() {
        for (what, ttl) in [("signed", 3600), ("short", 1)] {
            let url = remote
                .signed_get(".datasets", name, std::time::Duration::from_secs(ttl))
                .unwrap_or_else(|e| panic!("signing failed: {e:#}"))
                .expect("an Azure store signs URLs");
            println!("{what}={}", url.expose());
        }
    }
}

/// Runs [`child`] against the fake with a user's environment: `az` first on PATH, the account named,
/// the fake's endpoint in plain HTTP, no other Azure credential.
fn run_child(fake: &Emulator, file: &Path, account: Option<&str>) -> (bool, String) {
    run_child_with(fake, file, account, true, &[])
}

/// [`run_child`], with or without the signed-in `az`, and with `env` set.
fn run_child_with(
    fake: &Emulator,
    file: &Path,
    account: Option<&str>,
    signed_in: bool,
    env: &[(&str, &str)],
) -> (bool, String) {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["child", "--exact", "--nocapture", "--test-threads=1"]);
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("AZURE_") {
            cmd.env_remove(k);
        }
    }
    let path = match signed_in {
        true => format!(
            "{}:{}",
            fake.str("bin"),
            std::env::var("PATH").unwrap_or_default()
        ),
        false => "/usr/bin:/bin".to_string(),
    };
    cmd.env("PHYSALIA_AZURE_CHILD", file)
        .env(
            "PHYSALIA_AZURE_URL",
            format!("az://{}/runs", fake.str("container")),
        )
        .env("PATH", path)
        .env("AZURE_STORAGE_ENDPOINT", fake.str("blob"))
        .env("AZURE_ALLOW_HTTP", "true");
    if let Some(account) = account {
        cmd.env("AZURE_STORAGE_ACCOUNT_NAME", account);
    }
    cmd.envs(env.iter().copied());
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// Issue 30: a 100 MiB dataset goes to `az://` in blocks of at most 32 MiB (Put Block, then one Put
/// Block List) and comes back with the same checksum; a file that fits one request is one Put Blob.
#[test]
fn issue_30_a_100_mib_dataset_goes_to_az_and_back_through_block_uploads() {
    let Some(fake) = fake() else { return };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("big.safetensors");
    write_dataset(&file, DATASET_BYTES);
    let (ok, out) = run_child(&fake, &file, Some(fake.str("account")));
    assert!(ok, "{out}");
    assert!(out.contains(&format!("size={DATASET_BYTES}")), "{out}");
    assert!(out.contains("roundtrip ok"), "{out}");
    assert_eq!(checksum(&file), checksum(&file.with_extension("back")));

    let key = format!(
        "/{}/{}/runs/.datasets/0123456789abcdef-big.safetensors",
        fake.str("account"),
        fake.str("container")
    );
    let all = requests(&fake);
    let puts: Vec<&Value> = all
        .iter()
        .filter(|r| r["method"] == "PUT" && r["path"] == key.as_str())
        .collect();
    let blocks: Vec<u64> = puts
        .iter()
        .filter(|r| r["comp"] == "block")
        .map(|r| r["bytes"].as_u64().unwrap())
        .collect();
    assert_eq!(
        blocks.iter().sum::<u64>(),
        DATASET_BYTES as u64,
        "the blocks hold the file: {puts:?}"
    );
    assert_eq!(blocks.len(), DATASET_BYTES.div_ceil(32 << 20), "{blocks:?}");
    assert!(blocks.iter().all(|&b| b <= 32 << 20), "{blocks:?}");
    let lists = puts.iter().filter(|r| r["comp"] == "blocklist").count();
    let whole = puts.iter().filter(|r| r["comp"].is_null()).count();
    assert_eq!(
        (lists, whole),
        (1, 0),
        "one Put Block List, no Put Blob: {puts:?}"
    );
    assert_eq!(
        puts.last().unwrap()["comp"],
        "blocklist",
        "committed last: {puts:?}"
    );
}

/// Issue 30: without `AZURE_STORAGE_ACCOUNT_NAME` the store says which variable to set and for which
/// URL, instead of object_store's "Account must be specified".
#[test]
fn issue_30_a_missing_storage_account_names_the_variable() {
    let Some(fake) = fake() else { return };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("small.bin");
    std::fs::write(&file, b"small").unwrap();
    let (ok, out) = run_child(&fake, &file, None);
    assert!(!ok, "{out}");
    assert!(out.contains("AZURE_STORAGE_ACCOUNT_NAME"), "{out}");
    assert!(out.contains("az://jobs/runs"), "{out}");
    assert!(!out.contains("Account must be specified"), "{out}");
}

/// The fake refuses what Blob Storage refuses, and keeps uncommitted blocks out of sight: a block list
/// naming a block never put (nothing committed, the blob still absent), block ids of unequal length in
/// one blob, an id that is not Base64, a block over 4000 MiB (refused from its Content-Length, the body
/// never read), a block list naming a block as committed that is only uncommitted; a good list commits
/// in its order, `Latest` taking the newest upload of an id; the blocks it leaves out are gone and those
/// it took are committed ones now (a later list takes them as `Committed`, not `Uncommitted`).
#[test]
fn issue_30_the_blob_fake_refuses_a_bad_block_list_and_hides_uncommitted_blocks() {
    let Some(fake) = fake() else { return };
    let base = format!("{}/{}/", fake.str("blob"), fake.str("container"));
    let code = format!(
        r#"import base64, http.client, json, urllib.error, urllib.parse, urllib.request
base = {base:?}
def req(method, path, body=b""):
    r = urllib.request.Request(base + path, data=body if method == "PUT" else None, method=method,
                               headers={{"Authorization": "Bearer user.storage"}})
    try:
        with urllib.request.urlopen(r) as resp:
            return [resp.status, resp.read().decode()]
    except urllib.error.HTTPError as e:
        return [e.code, e.headers.get("x-ms-error-code")]
def bid(s):
    return base64.b64encode(s.encode()).decode()
def block(name, s, data):
    return req("PUT", name + "?comp=block&blockid=" + urllib.parse.quote(bid(s), safe=""), data)
def blocklist(name, items):
    xml = '<?xml version="1.0" encoding="utf-8"?>\n<BlockList>' + "".join(
        "<%s>%s</%s>" % (t, bid(i), t) for t, i in items) + "</BlockList>"
    return req("PUT", name + "?comp=blocklist", xml.encode())
out = {{}}
out["put_a"] = block("b", "0001", b"aaa")
out["put_b"] = block("b", "0002", b"bb")
out["uncommitted_get"] = req("GET", "b")
out["uncommitted_listed"] = "<Name>b</Name>" in req("GET", "?restype=container&comp=list")[1]
out["unknown_block"] = blocklist("b", [("Uncommitted", "0001"), ("Uncommitted", "0009")])
out["after_refusal"] = req("GET", "b")
out["unequal_length"] = block("b", "03", b"c")
out["not_base64"] = req("PUT", "b?comp=block&blockid=%25%25%25", b"c")
out["not_yet_committed"] = blocklist("b", [("Committed", "0001")])
c = http.client.HTTPConnection(urllib.parse.urlsplit(base).netloc)
c.putrequest("PUT", urllib.parse.urlsplit(base).path + "b?comp=block&blockid=" + urllib.parse.quote(bid("0003"), safe=""))
c.putheader("Authorization", "Bearer user.storage")
c.putheader("Content-Length", str(4000 * 2**20 + 1))
c.endheaders()
r = c.getresponse()
out["too_large"] = [r.status, r.getheader("x-ms-error-code")]
out["put_b_again"] = block("b", "0002", b"BB")
out["put_left_out"] = block("b", "0004", b"zz")
out["commit"] = blocklist("b", [("Latest", "0002"), ("Uncommitted", "0001")])[0]
out["committed"] = req("GET", "b")
out["left_out_gone"] = blocklist("b", [("Latest", "0004")])
out["uncommitted_once"] = blocklist("b", [("Uncommitted", "0001")])
out["recommit"] = blocklist("b", [("Committed", "0001"), ("Latest", "0002")])[0]
out["recommitted"] = req("GET", "b")
print(json.dumps(out))
"#
    );
    let got = python(&code);
    let expect = serde_json::json!({
        "put_a": [201, ""],
        "put_b": [201, ""],
        "uncommitted_get": [404, "BlobNotFound"],
        "uncommitted_listed": false,
        "unknown_block": [400, "InvalidBlockList"],
        "after_refusal": [404, "BlobNotFound"],
        "unequal_length": [400, "InvalidBlobOrBlock"],
        "not_base64": [400, "InvalidQueryParameterValue"],
        "not_yet_committed": [400, "InvalidBlockList"],
        "too_large": [413, "RequestBodyTooLarge"],
        "put_b_again": [201, ""],
        "put_left_out": [201, ""],
        "commit": 201,
        "committed": [200, "BBaaa"],
        "left_out_gone": [400, "InvalidBlockList"],
        "uncommitted_once": [400, "InvalidBlockList"],
        "recommit": 201,
        "recommitted": [200, "aaaBB"],
    });
    assert_eq!(got, expect);
}

/// Issue 30: the store's tokens come from Azure's one credential chain, the aci backend's
/// (`AzureCredentialChain`): signed out and off Azure, the error names what the chain tried (the
/// managed identity, the Azure CLI) for the Storage scope; a client secret in the environment is
/// refused naming the variable, never echoing the secret.
#[test]
fn issue_30_the_store_takes_azures_one_credential_chain() {
    let Some(fake) = fake() else { return };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("small.bin");
    std::fs::write(&file, b"small").unwrap();
    let (ok, out) = run_child_with(&fake, &file, Some(fake.str("account")), false, &[]);
    assert!(!ok, "{out}");
    assert!(
        out.contains("https://storage.azure.com/.default"),
        "the Storage scope: {out}"
    );
    assert!(out.contains("the managed identity"), "{out}");
    assert!(out.contains("the Azure CLI"), "{out}");
    assert!(out.contains("az login"), "{out}");
    // the store was never asked (the fake's own `/_fake/requests` is in its list)
    let store = format!("/{}/", fake.str("account"));
    let sent: Vec<Value> = requests(&fake)
        .into_iter()
        .filter(|r| r["path"].as_str().is_some_and(|p| p.starts_with(&store)))
        .collect();
    assert!(sent.is_empty(), "no request went without a token: {sent:?}");
    let secret = "not-a-real-secret-8b1f";
    let (ok, out) = run_child_with(
        &fake,
        &file,
        Some(fake.str("account")),
        true,
        &[
            ("AZURE_CLIENT_SECRET", secret),
            ("AZURE_TENANT_ID", "00000000-0000-0000-0000-0000000000aa"),
            ("AZURE_CLIENT_ID", "c0000000-0000-0000-0000-00000000c009"),
        ],
    );
    assert!(!ok, "{out}");
    assert!(out.contains("AZURE_CLIENT_SECRET is set"), "{out}");
    assert!(out.contains("AZURE_CLIENT_SECRET_FILE"), "{out}");
    assert!(!out.contains(secret), "the secret is never said: {out}");
}

/// Issue 31: an Azure store signs URLs, so that cluster-mode workers read their chunk files from Blob
/// Storage themselves: `Remote::signed_get` (object_store's signer) asks Blob Storage for a user
/// delegation key with the signed-in principal's token and signs a read SAS of one blob with it. The
/// URL alone, no token, reads the blob (whole and by range); the fake verifies the SAS as Azure
/// documents it and refuses a changed signature, the same signature on another blob, a write with a
/// read SAS, a SAS past its expiry, a key asked for with a SAS, and a key of more than 7 days.
#[test]
fn issue_31_an_az_store_signs_read_urls_the_fake_verifies() {
    let Some(fake) = fake() else { return };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("small.bin");
    write_dataset(&file, 300_000);
    let (ok, out) = run_child_with(
        &fake,
        &file,
        Some(fake.str("account")),
        true,
        &[("PHYSALIA_AZURE_SIGN", "1")],
    );
    assert!(ok, "{out}");
    let url = |what: &str| -> String {
        out.lines()
            .find_map(|l| l.strip_prefix(&format!("{what}=")))
            .unwrap_or_else(|| panic!("no {what} URL: {out}"))
            .to_string()
    };
    let (signed, short) = (url("signed"), url("short"));
    // a user delegation SAS: read, one blob, the key's fields, no token of the user's in it
    for field in ["sp=r", "sr=b", "skoid=", "sktid=", "ske=", "sig="] {
        assert!(signed.contains(field), "{field} in {signed}");
    }
    assert!(!signed.contains("user.storage"), "{signed}");
    let root = format!("{}/", blob_root(&fake));
    let code = format!(
        r#"import hashlib, json, time, urllib.error, urllib.request
def req(url, method="GET", headers={{}}, body=None):
    r = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(r) as resp:
            return [resp.status, hashlib.sha256(resp.read()).hexdigest()]
    except urllib.error.HTTPError as e:
        return [e.code, e.headers.get("x-ms-error-code")]
signed, short, root = {signed:?}, {short:?}, {root:?}
head, _, query = signed.partition("?")
out = {{}}
out["get"] = req(signed)
out["range"] = req(signed, headers={{"Range": "bytes=0-99"}})[0]
sig = query.split("sig=")[1].split("&")[0]
out["changed_signature"] = req(signed.replace("sig=" + sig, "sig=A" + sig[1:] if sig[0] != "A" else "sig=B" + sig[1:]))
out["another_blob"] = req(head.rsplit("/", 1)[0] + "/other.bin?" + query)
out["write"] = req(signed, "PUT", {{"x-ms-blob-type": "BlockBlob"}}, b"x")
key_url = root + "{account}?restype=service&comp=userdelegationkey"
now = time.gmtime()
def key_info(days):
    expiry = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + days * 86400))
    return ("<KeyInfo><Expiry>%s</Expiry></KeyInfo>" % expiry).encode()
out["key_with_sas"] = req(key_url + "&" + query, "POST", {{}}, key_info(1))
out["key_8_days"] = req(key_url, "POST", {{"Authorization": "Bearer user.storage"}}, key_info(8))
out["key_1_day"] = req(key_url, "POST", {{"Authorization": "Bearer user.storage"}}, key_info(1))[0]
time.sleep(2.5)
out["expired"] = req(short)
print(json.dumps(out))
"#,
        account = fake.str("account"),
    );
    let got = python(&code);
    let expect = serde_json::json!({
        "get": [200, checksum(&file)],
        "range": 206,
        "changed_signature": [403, "AuthenticationFailed"],
        "another_blob": [403, "AuthenticationFailed"],
        "write": [403, "AuthorizationPermissionMismatch"],
        "key_with_sas": [403, "AuthenticationFailed"],
        "key_8_days": [400, "InvalidXmlNodeValue"],
        "key_1_day": 200,
        "expired": [403, "AuthenticationFailed"],
    });
    assert_eq!(got, expect);
    // the read went in as the SAS's principal, the signed-in user, without a token
    let name = "/runs/.datasets/0123456789abcdef-big.safetensors";
    let reads: Vec<Value> = requests(&fake)
        .into_iter()
        .filter(|r| r["method"] == "GET" && r["path"].as_str().is_some_and(|p| p.ends_with(name)))
        .collect();
    assert!(
        reads.iter().any(|r| r["who"] == "sas:user"),
        "a read by the SAS: {reads:?}"
    );
}

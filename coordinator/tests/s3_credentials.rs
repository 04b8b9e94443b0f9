//! S3 job stores take aws-config's credential chain and region (src/store.rs, `s3_builder`), against
//! moto's S3 on loopback with authentication enforced: moto then accepts only the keys of the IAM users
//! it made (`backends/tests/ecs/moto_fixture.py --enforce-auth`), so a store that reads its keys from
//! anywhere but the profile under test is refused.
//!
//! The environment is the process's: each case runs [`child`] in a process of its own (this test
//! binary again), with every `AWS_*` variable of ours removed and only the case's set.
//!
//! Without moto the tests print `skipping` and pass, unless `PHYSALIA_REQUIRE_MOTO=1` (CI sets it).

use std::path::PathBuf;
use std::process::Command;

use physalia_testkit::{Emulator, Spawn, python};

const BUCKET: &str = "physalia-jobs";
const URL: &str = "s3://physalia-jobs/jobs";
/// The region only the profile names; the bucket is made there.
const REGION: &str = "eu-west-1";

/// moto_fixture.py's server with authentication enforced; stopped on drop.
struct Moto {
    server: Emulator,
}

impl Moto {
    /// `None` (and a note) where moto is not installed and not required.
    fn start() -> Option<Moto> {
        let server = Spawn::new("backends/tests/ecs/moto_fixture.py")
            .args(&["--enforce-auth"])
            .python(&["moto.server", "boto3"])
            .start()?;
        let moto = Moto { server };
        moto.create_bucket();
        Some(moto)
    }

    fn endpoint(&self) -> &str {
        self.server.info()["endpoint"].as_str().unwrap()
    }

    /// The keys of the IAM user that may do everything.
    fn launcher(&self) -> (String, String) {
        let user = &self.server.info()["users"]["launcher"];
        (
            user["key"].as_str().unwrap().to_string(),
            user["secret"].as_str().unwrap().to_string(),
        )
    }

    /// Session credentials (key, secret, token) of a role that may use S3, which moto checks whole:
    /// a request signed with them but without the token is refused.
    fn session(&self) -> (String, String, String) {
        let (key, secret) = self.launcher();
        let code = format!(
            "import boto3, json\nkw = dict(endpoint_url={:?}, region_name='us-east-1', aws_access_key_id={key:?}, aws_secret_access_key={secret:?})\niam = boto3.client('iam', **kw)\ntrust = {{'Version': '2012-10-17', 'Statement': [{{'Effect': 'Allow', 'Principal': {{'AWS': '*'}}, 'Action': 'sts:AssumeRole'}}]}}\narn = iam.create_role(RoleName='physalia-store', AssumeRolePolicyDocument=json.dumps(trust))['Role']['Arn']\niam.put_role_policy(RoleName='physalia-store', PolicyName='s3', PolicyDocument=json.dumps({{'Version': '2012-10-17', 'Statement': [{{'Effect': 'Allow', 'Action': 's3:*', 'Resource': '*'}}]}}))\nc = boto3.client('sts', **kw).assume_role(RoleArn=arn, RoleSessionName='physalia-test')['Credentials']\nprint(json.dumps([c['AccessKeyId'], c['SecretAccessKey'], c['SessionToken']]))\n",
            self.endpoint()
        );
        // assuming the role
        let v: Vec<String> = serde_json::from_value(python(&code)).unwrap();
        (v[0].clone(), v[1].clone(), v[2].clone())
    }

    /// The bucket, in [`REGION`], made by the launcher.
    fn create_bucket(&self) {
        let (key, secret) = self.launcher();
        let code = format!(
            "import boto3\ns3 = boto3.client('s3', endpoint_url={:?}, region_name={REGION:?}, aws_access_key_id={key:?}, aws_secret_access_key={secret:?})\ns3.create_bucket(Bucket={BUCKET:?}, CreateBucketConfiguration={{'LocationConstraint': {REGION:?}}})\nassert s3.head_bucket(Bucket={BUCKET:?})['ResponseMetadata']['HTTPHeaders']['x-amz-bucket-region'] == {REGION:?}\n",
            self.endpoint()
        );
        // creating the bucket
        python(&code);
    }
}

/// A case's AWS configuration: `config` and `credentials` files in a home of its own.
struct Profiles {
    home: tempfile::TempDir,
}

impl Profiles {
    fn new(config: &str, credentials: &str) -> Profiles {
        let home = tempfile::tempdir().unwrap();
        std::fs::write(home.path().join("config"), config).unwrap();
        std::fs::write(home.path().join("credentials"), credentials).unwrap();
        Profiles { home }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.home.path().join(name)
    }

    /// An executable script (mode 0700) at `name` in the home.
    fn script(&self, name: &str, body: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = self.path(name);
        std::fs::write(&path, format!("#!/bin/sh\n{body}")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o700)).unwrap();
        path
    }

    /// Runs [`child`] with `AWS_PROFILE=profile`, these files and moto's endpoint, and no other `AWS_*`
    /// variable; returns whether it succeeded and what it printed.
    fn run(&self, moto: &Moto, profile: &str) -> (bool, String) {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(["child", "--exact", "--nocapture", "--test-threads=1"]);
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("AWS_") {
                cmd.env_remove(k);
            }
        }
        let out = cmd
            .env("PHYSALIA_S3_CHILD", "1")
            .env("HOME", self.home.path())
            .env("XDG_CACHE_HOME", self.home.path())
            .env("AWS_CONFIG_FILE", self.path("config"))
            .env("AWS_SHARED_CREDENTIALS_FILE", self.path("credentials"))
            .env("AWS_PROFILE", profile)
            .env("AWS_ENDPOINT_URL", moto.endpoint())
            .env("AWS_ALLOW_HTTP", "true")
            // no instance here: do not wait for its metadata service
            .env("AWS_EC2_METADATA_DISABLED", "true")
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    }
}

/// One case, in a process of its own (a no-op unless `PHYSALIA_S3_CHILD` is set): opens [`URL`] with
/// the process's environment, says the region, writes an object and reads it back.
#[test]
fn child() {
    if std::env::var_os("PHYSALIA_S3_CHILD").is_none() {
        return;
    }
    let remote = match physalia_coordinator::store::Remote::open(URL) {
        Ok(r) => r,
        Err(e) => panic!("open failed: {e:#}"),
    };
    println!("region={}", remote.s3_region().unwrap());
    let body = b"written through the profile".to_vec();
    if let Err(e) = remote.put("j-1", "hello.txt", body.clone()) {
        panic!("put failed: {e:#}");
    }
    let back = remote
        .get("j-1", "hello.txt")
        .unwrap_or_else(|e| panic!("get failed: {e:#}"));
    assert_eq!(back.as_deref(), Some(&body[..]));
    // (no listing: moto 5.2's signature check refuses object_store's signed ListObjectsV2 query,
    // `SignatureDoesNotMatch`, where real S3 takes it)
    println!("roundtrip ok");

    // a presigned GET (what a worker reads a chunk file with, issue 31): no credentials of its own,
    // the object's bytes; the same URL with its signature changed is refused
    let url = remote
        .signed_get("j-1", "hello.txt", std::time::Duration::from_secs(600))
        .unwrap_or_else(|e| panic!("signing failed: {e:#}"))
        .expect("S3 signs URLs");
    assert!(!format!("{url} {url:?}").contains("X-Amz-Signature"));
    let (status, got) = http_get(url.expose());
    assert_eq!((status, got), (200, body), "the presigned GET");
    let forged = url
        .expose()
        .replace("X-Amz-Signature=", "X-Amz-Signature=0");
    let (status, _) = http_get(&forged);
    assert_eq!(status, 403, "a forged signature");
    println!("presigned ok");
}

/// GET `url` (plain HTTP, as moto serves) with no credentials: the status and the body.
fn http_get(url: &str) -> (u16, Vec<u8>) {
    use std::io::{Read as _, Write as _};
    let rest = url.strip_prefix("http://").expect("moto is plain HTTP");
    let (host, target) = rest.split_at(rest.find('/').unwrap());
    let mut conn = std::net::TcpStream::connect(host).unwrap();
    write!(
        conn,
        "GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    conn.read_to_end(&mut raw).unwrap();
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let mut body = raw[split + 4..].to_vec();
    if chunked {
        let (mut out, mut rest) = (Vec::new(), &body[..]);
        loop {
            let end = rest.windows(2).position(|w| w == b"\r\n").unwrap();
            let n = usize::from_str_radix(std::str::from_utf8(&rest[..end]).unwrap().trim(), 16)
                .unwrap();
            if n == 0 {
                break;
            }
            out.extend_from_slice(&rest[end + 2..end + 2 + n]);
            rest = &rest[end + 4 + n..];
        }
        body = out;
    }
    (status, body)
}

fn assert_no_secret(output: &str, secrets: &[&str]) {
    for s in secrets {
        assert!(
            !output.contains(s),
            "a secret appears in the output: {output}"
        );
    }
}

/// Only a named profile: its keys in the shared credentials file, its region only in the config
/// file. The `default` profile's keys are unknown to moto and its region another: a store that ignored
/// AWS_PROFILE would be refused, one that ignored the profile's region would say so.
#[test]
fn a_named_profile_alone_reads_and_writes_in_its_region() {
    let Some(moto) = Moto::start() else { return };
    let (key, secret) = moto.launcher();
    let profiles = Profiles::new(
        &format!("[default]\nregion = us-west-2\n\n[profile dev]\nregion = {REGION}\n"),
        &format!(
            "[default]\naws_access_key_id = AKIADEFAULTDEFAULT00\naws_secret_access_key = not-the-default-secret\n\n[dev]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\n"
        ),
    );
    let (ok, out) = profiles.run(&moto, "dev");
    assert!(ok, "{out}");
    assert!(out.contains(&format!("region={REGION}")), "{out}");
    assert!(out.contains("roundtrip ok"), "{out}");
    assert!(out.contains("presigned ok"), "{out}");
    assert_no_secret(&out, &[&secret]);
}

/// A `credential_process` profile giving session credentials (an assumed role's key, secret and token,
/// which moto refuses without the token): reads and writes. Credentials
/// that do not expire soon are asked for once per process; ones that expire within the refresh margin
/// are asked for again before requests.
#[test]
fn a_credential_process_profile_reads_writes_and_refreshes() {
    let Some(moto) = Moto::start() else { return };
    let (key, secret, token) = moto.session();
    let token = token.as_str();
    let profiles = Profiles::new("", "");
    let calls = profiles.path("calls");
    let process = |name: &str, expiration: &str| {
        profiles.script(
            name,
            &format!(
                "echo x >> '{}'\nprintf '{{\"Version\": 1, \"AccessKeyId\": \"{key}\", \"SecretAccessKey\": \"{secret}\", \"SessionToken\": \"{token}\", \"Expiration\": \"%s\"}}\\n' \"{expiration}\"\n",
                calls.display()
            ),
        )
    };
    let lasting = process("lasting.sh", "2099-01-01T00:00:00Z");
    // two minutes from now: inside the five-minute margin, so fetched again before each request
    let soon = process(
        "soon.sh",
        "$(date -u -d @$(( $(date +%s) + 120 )) +%Y-%m-%dT%H:%M:%SZ)",
    );
    std::fs::write(
        profiles.path("config"),
        format!(
            "[profile lasting]\nregion = {REGION}\ncredential_process = {}\n\n[profile soon]\nregion = {REGION}\ncredential_process = {}\n",
            lasting.display(),
            soon.display()
        ),
    )
    .unwrap();
    let count = || {
        std::fs::read_to_string(&calls)
            .map(|s| s.lines().count())
            .unwrap_or(0)
    };

    let (ok, out) = profiles.run(&moto, "lasting");
    assert!(ok, "{out}");
    assert!(out.contains(&format!("region={REGION}")), "{out}");
    assert!(out.contains("roundtrip ok"), "{out}");
    assert_no_secret(&out, &[&secret, token]);
    assert_eq!(count(), 1, "lasting credentials are asked for once");

    std::fs::remove_file(&calls).unwrap();
    let (ok, out) = profiles.run(&moto, "soon");
    assert!(ok, "{out}");
    assert_no_secret(&out, &[&secret, token]);
    // open, put, get: each finds them about to expire
    assert!(
        count() >= 3,
        "credentials about to expire are fetched again: {} calls",
        count()
    );
}

/// The chain is what is consulted: a profile whose `credential_process` fails makes `open` fail with
/// an error naming the profile and the process's failure, though the `default` profile has keys moto
/// accepts; a profile with keys moto does not know fails at its first request; no key appears in
/// either error.
#[test]
fn a_failing_profile_fails_naming_it_and_no_secret_leaks() {
    let Some(moto) = Moto::start() else { return };
    let (key, secret) = moto.launcher();
    let profiles = Profiles::new(
        "",
        &format!(
            "[default]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\n\n[wrong]\naws_access_key_id = AKIAWRONGWRONGWRONG0\naws_secret_access_key = wrong-secret-never-shown\n"
        ),
    );
    let broken = profiles.script(
        "broken.sh",
        "echo 'the SSO session has expired' >&2\nexit 3\n",
    );
    std::fs::write(
        profiles.path("config"),
        format!(
            "[profile broken]\nregion = {REGION}\ncredential_process = {}\n\n[profile wrong]\nregion = {REGION}\n",
            broken.display()
        ),
    )
    .unwrap();

    let (ok, out) = profiles.run(&moto, "broken");
    assert!(!ok, "{out}");
    assert!(out.contains("open failed"), "{out}");
    assert!(out.contains("profile `broken` (AWS_PROFILE)"), "{out}");
    assert!(out.contains("exit status: 3"), "{out}");
    assert!(out.contains("the SSO session has expired"), "{out}");
    assert_no_secret(&out, &[&secret]);

    let (ok, out) = profiles.run(&moto, "wrong");
    assert!(!ok, "{out}");
    assert!(out.contains("put failed"), "{out}");
    assert!(
        out.contains("403") || out.contains("InvalidAccessKeyId"),
        "{out}"
    );
    assert_no_secret(&out, &[&secret, "wrong-secret-never-shown"]);

    // the same files with the `default` profile: the chain's keys work, so the failures were the profiles'
    let (ok, out) = profiles.run(&moto, "default");
    assert!(ok, "{out}");
}

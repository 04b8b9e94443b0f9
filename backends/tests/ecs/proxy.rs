//! A loopback HTTP proxy in front of moto that throttles one ECS operation: the first `times` requests
//! for it get ECS's `ThrottlingException` answer (HTTP 400, as ECS sends it); everything else is
//! forwarded untouched. Moto has no throttling of its own.

use std::collections::BTreeSet;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;

pub struct Throttle {
    addr: SocketAddr,
    seen: Arc<AtomicU32>,
    targets: Arc<Mutex<BTreeSet<String>>>,
}

impl Throttle {
    /// Throttles the first `times` requests for `operation` (e.g. `RunTask`) on their way to `upstream`.
    pub async fn start(upstream: String, operation: &'static str, times: u32) -> Throttle {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(AtomicU32::new(0));
        let targets = Arc::new(Mutex::new(BTreeSet::new()));
        let client = reqwest::Client::new();
        let counter = seen.clone();
        let record = targets.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let (client, upstream, counter, record) = (
                    client.clone(),
                    upstream.clone(),
                    counter.clone(),
                    record.clone(),
                );
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                        let (client, upstream, counter, record) = (
                            client.clone(),
                            upstream.clone(),
                            counter.clone(),
                            record.clone(),
                        );
                        async move {
                            Ok::<_, Infallible>(
                                forward(
                                    &client, &upstream, operation, times, &counter, &record, req,
                                )
                                .await,
                            )
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Throttle {
            addr,
            seen,
            targets,
        }
    }

    /// Every operation that went through, as IAM names its action: `ecs:RunTask`,
    /// `secretsmanager:CreateSecret`, `logs:GetLogEvents`.
    pub fn actions(&self) -> BTreeSet<String> {
        self.targets.lock().unwrap().clone()
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Requests for the operation so far, throttled or not.
    pub fn seen(&self) -> u32 {
        self.seen.load(Ordering::SeqCst)
    }
}

async fn forward(
    client: &reqwest::Client,
    upstream: &str,
    operation: &str,
    times: u32,
    seen: &AtomicU32,
    record: &Mutex<BTreeSet<String>>,
    req: Request<Incoming>,
) -> Response<Full<Bytes>> {
    let target = req
        .headers()
        .get("x-amz-target")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    // `AmazonEC2ContainerServiceV20141113.RunTask`, `secretsmanager.CreateSecret`,
    // `Logs_20140328.GetLogEvents`: the JSON protocols name the operation in this header
    if let Some((service, op)) = target.split_once('.') {
        let prefix = match service {
            "AmazonEC2ContainerServiceV20141113" => "ecs",
            "secretsmanager" => "secretsmanager",
            "Logs_20140328" => "logs",
            "ServiceQuotasV20190624" => "servicequotas",
            other => other,
        };
        record.lock().unwrap().insert(format!("{prefix}:{op}"));
    }
    if target.ends_with(&format!(".{operation}")) {
        let n = seen.fetch_add(1, Ordering::SeqCst);
        if n < times {
            return Response::builder()
                .status(400)
                .header("content-type", "application/x-amz-json-1.1")
                .header("x-amzn-requestid", format!("throttled-{n}"))
                .body(Full::new(Bytes::from(
                    r#"{"__type":"ThrottlingException","message":"Rate exceeded"}"#,
                )))
                .unwrap();
        }
    }
    let (parts, body) = req.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    let url = format!(
        "{upstream}{}",
        parts
            .uri
            .path_and_query()
            .map(|p| p.as_str())
            .unwrap_or("/")
    );
    let mut out = client.request(parts.method.clone(), url).body(body);
    for (name, value) in &parts.headers {
        if name != hyper::header::HOST && name != hyper::header::CONTENT_LENGTH {
            out = out.header(name.as_str(), value.as_bytes());
        }
    }
    let resp = out.send().await.unwrap();
    let mut back = Response::builder().status(resp.status().as_u16());
    for (name, value) in resp.headers() {
        if name != reqwest::header::CONTENT_LENGTH && name != reqwest::header::TRANSFER_ENCODING {
            back = back.header(name.as_str(), value.as_bytes());
        }
    }
    back.body(Full::new(resp.bytes().await.unwrap())).unwrap()
}

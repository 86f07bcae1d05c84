//! Redis over TLS (with and without client certificates) and behind a password-protected Sentinel.

use super::*;

async fn tls_store(target: &RedisTarget, tls: &RedisTls) -> Result<RedisStore, StoreError> {
    RedisStore::connect_with(target, Duration::from_millis(500), ColdStart::Full, tls).await
}

/// A certificate authority and a certificate it signed for 127.0.0.1, in `dir`:
/// (`ca.pem`, `server.pem`, `server.key`).
/// Run `openssl` with `args` in `dir`; it must succeed.
fn openssl_in(dir: &std::path::Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn tls_files(dir: &std::path::Path) -> [std::path::PathBuf; 3] {
    std::fs::create_dir_all(dir).unwrap();
    let p = |name: &str| dir.join(name);
    let openssl = |args: &[&str]| openssl_in(dir, args);
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
    ]);
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
    ]);
    std::fs::write(p("san.ext"), "subjectAltName=IP:127.0.0.1\n").unwrap();
    openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "san.ext",
        "-out",
        "server.pem",
    ]);
    [p("ca.pem"), p("server.pem"), p("server.key")]
}

/// A redis-server serving TLS with the certificate [`tls_files`] made in `dir`, asking clients for
/// theirs when `auth_clients`: the server, its `rediss://` target and the authority's PEM.
fn tls_redis(dir: &std::path::Path, auth_clients: bool) -> (Redis, RedisTarget, Vec<u8>) {
    let [ca, cert, key] = tls_files(dir);
    let tls_port = free_port();
    let redis = Redis::start_with(&[
        "--tls-port",
        &tls_port.to_string(),
        "--tls-cert-file",
        cert.to_str().unwrap(),
        "--tls-key-file",
        key.to_str().unwrap(),
        "--tls-ca-cert-file",
        ca.to_str().unwrap(),
        "--tls-auth-clients",
        if auth_clients { "yes" } else { "no" },
    ]);
    let target = RedisTarget::Single(format!("rediss://127.0.0.1:{tls_port}"));
    (redis, target, std::fs::read(&ca).unwrap())
}

/// A client certificate the authority in `dir` (made by [`tls_files`]) signed: (pem, key).
fn client_certificate(dir: &std::path::Path) -> (Vec<u8>, Vec<u8>) {
    // Extensions make it a version 3 certificate, the only kind rustls reads.
    std::fs::write(
        dir.join("client.ext"),
        "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n",
    )
    .unwrap();
    for args in [
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=tollgate-quota",
            "-keyout",
            "client.key",
            "-out",
            "client.csr",
        ][..],
        &[
            "x509",
            "-req",
            "-in",
            "client.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "client.ext",
            "-out",
            "client.pem",
        ][..],
    ] {
        openssl_in(dir, args);
    }
    (
        std::fs::read(dir.join("client.pem")).unwrap(),
        std::fs::read(dir.join("client.key")).unwrap(),
    )
}

#[tokio::test]
async fn a_redis_that_asks_for_client_certificates_is_served_with_one() {
    let dir = std::env::temp_dir().join(format!("tollgate-mtls-{}", std::process::id()));
    let (_redis, target, ca) = tls_redis(&dir, true);
    let with = RedisTls {
        ca_pem: Some(ca.clone()),
        client_pem: Some(client_certificate(&dir)),
    };
    let store = Store::Redis(tls_store(&target, &with).await.unwrap());
    assert_eq!(
        store.lease("a", &[item("k", 5, 2)], 10_000).await.unwrap()[0].granted,
        2
    );
    let without = RedisTls {
        ca_pem: Some(ca),
        client_pem: None,
    };
    assert!(tls_store(&target, &without).await.is_err());
    assert!(
        !format!("{with:?}").contains("PRIVATE"),
        "the key never reaches a log"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn redis_over_tls_is_served_when_its_authority_is_trusted() {
    let dir = std::env::temp_dir().join(format!("tollgate-tls-{}", std::process::id()));
    let (redis, target, ca) = tls_redis(&dir, false);
    let trust = RedisTls {
        ca_pem: Some(ca),
        client_pem: None,
    };
    let store = Store::Redis(tls_store(&target, &trust).await.unwrap());
    assert_eq!(
        store.lease("a", &[item("k", 5, 2)], 10_000).await.unwrap()[0].granted,
        2
    );
    // Not trusted (the system's authorities do not know this one): no connection.
    assert!(tls_store(&target, &RedisTls::default()).await.is_err());
    drop(redis);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_password_protected_master_behind_sentinel_is_served() {
    let master = Redis::start_with(&["--requirepass", "m4ster-secret"]);
    let dir = std::env::temp_dir().join(format!("tollgate-sentinel-auth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("sentinel.conf");
    std::fs::write(
        &file,
        format!(
            "sentinel monitor tgauth 127.0.0.1 {} 1\nsentinel auth-pass tgauth m4ster-secret\n",
            master.port
        ),
    )
    .unwrap();
    let sentinel = Redis::sentinel(file.to_str().unwrap());
    let target = |password: Option<&str>| RedisTarget::Sentinel {
        sentinels: vec![sentinel.url()],
        master: "tgauth".into(),
        access: MasterAccess {
            password: password.map(str::to_owned),
            ..MasterAccess::default()
        },
    };
    let store = Store::Redis(
        RedisStore::connect(
            &target(Some("m4ster-secret")),
            Duration::from_millis(500),
            ColdStart::Full,
        )
        .await
        .unwrap(),
    );
    assert_eq!(
        store.lease("a", &[item("k", 5, 2)], 10_000).await.unwrap()[0].granted,
        2
    );
    // Without the password the master refuses (before, that was the only way).
    let without =
        RedisStore::connect(&target(None), Duration::from_millis(500), ColdStart::Full).await;
    assert!(without.is_err());
    drop(sentinel);
    let _ = std::fs::remove_dir_all(&dir);
}

//! Who is calling: the shared token, or a proxy's own token, which binds the instances it may
//! speak for, and how many live instances a credential may have.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tollgate_core::bearer::{bearer_token, constant_time_eq};

/// Shortest proxy token accepted: a token anyone could guess protects nothing.
pub const MIN_TOKEN_BYTES: usize = 16;

/// Longest proxy name (it prefixes the proxy's instance names).
pub const MAX_PROXY_NAME: usize = 64;

/// Live instances per credential when `--max-instances` is not given.
pub const DEFAULT_MAX_INSTANCES: usize = 1_024;

/// One proxy's credential (`--proxy-token NAME=TOKEN`).
#[derive(Clone)]
pub struct ProxyToken {
    pub name: String,
    pub token: String,
}

impl ProxyToken {
    /// Read `NAME=TOKEN`. The error never repeats the token.
    pub fn parse(s: &str) -> Result<Self, String> {
        let Some((name, token)) = s.split_once('=') else {
            return Err("--proxy-token: expected NAME=TOKEN".into());
        };
        let name_ok = !name.is_empty()
            && name.len() <= MAX_PROXY_NAME
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
        if !name_ok {
            return Err(format!(
                "--proxy-token {name:?}: a name is 1 to {MAX_PROXY_NAME} letters, digits, '.', '_' \
                 or '-'"
            ));
        }
        if token.len() < MIN_TOKEN_BYTES {
            return Err(format!(
                "--proxy-token {name}: the token must be at least {MIN_TOKEN_BYTES} bytes"
            ));
        }
        Ok(Self {
            name: name.into(),
            token: token.into(),
        })
    }
}

/// The credential a call presented.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// No token is required (a service on loopback without `--token` or `--proxy-token`).
    Anyone,
    /// The shared `--token`: it may name any instance (not one under a proxy's name).
    Shared,
    /// A proxy's own token: its instances are `<name>/<instance>`, nobody else's.
    Proxy(String),
}

/// The service's credentials and the instances each has used lately.
pub struct Credentials {
    shared: Option<String>,
    proxies: Vec<ProxyToken>,
    max_instances: usize,
    /// How long an instance counts as live after its last call (a lease's term).
    term: Duration,
    live: Mutex<HashMap<String, HashMap<String, Instant>>>,
}

impl Credentials {
    pub fn new(
        shared: Option<String>,
        proxies: Vec<ProxyToken>,
        max_instances: usize,
        term: Duration,
    ) -> Self {
        Self {
            shared,
            proxies,
            max_instances: max_instances.max(1),
            term,
            live: Mutex::new(HashMap::new()),
        }
    }

    /// Anyone who can reach the service may call it.
    pub fn open(term: Duration) -> Self {
        Self::new(None, Vec::new(), DEFAULT_MAX_INSTANCES, term)
    }

    /// True if calls must present a token.
    pub fn required(&self) -> bool {
        self.shared.is_some() || !self.proxies.is_empty()
    }

    /// How many credentials there are: the shared token (or none at all) and each proxy token.
    pub fn count(&self) -> usize {
        (self.proxies.len() + usize::from(self.shared.is_some())).max(1)
    }

    /// The caller an `Authorization` header value proves, if any.
    pub fn caller(&self, authorization: Option<&str>) -> Option<Caller> {
        if !self.required() {
            return Some(Caller::Anyone);
        }
        let given = bearer_token(authorization?.as_bytes())?;
        // Every token is compared (in constant time each), whichever matches.
        let mut proxy = None;
        for p in &self.proxies {
            if constant_time_eq(given, p.token.as_bytes()) {
                proxy = Some(p.name.clone());
            }
        }
        let shared = self
            .shared
            .as_ref()
            .is_some_and(|t| constant_time_eq(given, t.as_bytes()));
        match (proxy, shared) {
            (Some(name), _) => Some(Caller::Proxy(name)),
            (None, true) => Some(Caller::Shared),
            (None, false) => None,
        }
    }

    /// The instance a call acts as, or why it may not: a proxy's calls act as
    /// `<name>/<instance>`, so no credential can speak for another's instances (free its slots,
    /// take its reservations); a name with '/' is refused from anyone, so none can pose as a
    /// proxy's. A credential that already has `max_instances` live instances cannot add another:
    /// inventing instances does not buy fair shares without end.
    pub fn bind(&self, caller: &Caller, instance: &str) -> Result<String, String> {
        if instance.contains('/') {
            return Err("instance must not contain '/'".into());
        }
        let (credential, bound) = match caller {
            Caller::Proxy(name) => (name.as_str(), format!("{name}/{instance}")),
            Caller::Shared | Caller::Anyone => ("", instance.to_owned()),
        };
        let now = Instant::now();
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        let instances = live.entry(credential.to_owned()).or_default();
        if let Some(seen) = instances.get_mut(&bound) {
            *seen = now;
            return Ok(bound);
        }
        if instances.len() >= self.max_instances {
            let term = self.term;
            instances.retain(|_, seen| now.duration_since(*seen) < term);
        }
        if instances.len() >= self.max_instances {
            let who = match caller {
                Caller::Proxy(name) => format!("proxy token {name}"),
                _ => "the shared token".into(),
            };
            // The operator who reads this in a proxy's failures learns the way out: a fleet
            // that shares one token shares this budget with whoever else holds the token.
            return Err(format!(
                "{who} has {} live instances, the most --max-instances allows; give each proxy \
                 or fleet its own --proxy-token NAME=TOKEN, or raise --max-instances",
                instances.len()
            ));
        }
        instances.insert(bound.clone(), now);
        Ok(bound)
    }
}

/// The instance a gRPC call acts as: its `authorization` metadata proves the caller (as the HTTP
/// API's header does), bound to `instance` ([`Credentials::bind`]).
pub fn bind_grpc_instance(
    credentials: &Credentials,
    metadata: &tonic::metadata::MetadataMap,
    instance: &str,
) -> Result<String, tonic::Status> {
    let given = metadata.get("authorization").and_then(|v| v.to_str().ok());
    let caller = match credentials.caller(given) {
        None => {
            return Err(tonic::Status::unauthenticated(
                "missing or wrong bearer token",
            ))
        }
        // (No token required: the instance is named as the shared token's would be.)
        Some(Caller::Anyone) => Caller::Shared,
        Some(c) => c,
    };
    credentials
        .bind(&caller, instance)
        .map_err(tonic::Status::permission_denied)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TERM: Duration = Duration::from_secs(10);

    fn two_proxies(max: usize) -> Credentials {
        let p = |s: &str| ProxyToken::parse(s).unwrap();
        Credentials::new(
            Some("shared-secret".into()),
            vec![p("edge-a=aaaaaaaaaaaaaaaa1"), p("edge-b=bbbbbbbbbbbbbbbb2")],
            max,
            TERM,
        )
    }

    #[test]
    fn each_token_proves_its_own_caller_and_binds_its_instances() {
        let c = two_proxies(8);
        let a = c.caller(Some("Bearer aaaaaaaaaaaaaaaa1")).unwrap();
        assert_eq!(a, Caller::Proxy("edge-a".into()));
        assert_eq!(c.bind(&a, "proxy-1").unwrap(), "edge-a/proxy-1");
        let b = c.caller(Some("Bearer bbbbbbbbbbbbbbbb2")).unwrap();
        assert_eq!(c.bind(&b, "proxy-1").unwrap(), "edge-b/proxy-1");
        assert_eq!(c.caller(Some("Bearer shared-secret")), Some(Caller::Shared));
        assert_eq!(c.caller(Some("Bearer nope")), None);
        assert_eq!(c.caller(None), None);
        // Nobody poses as a proxy's instance.
        assert!(c.bind(&Caller::Shared, "edge-a/proxy-1").is_err());
        assert!(c.bind(&a, "edge-b/proxy-1").is_err());
    }

    #[test]
    fn a_credential_cannot_invent_instances_without_end() {
        let c = two_proxies(3);
        let a = Caller::Proxy("edge-a".into());
        for i in 0..3 {
            c.bind(&a, &format!("p{i}")).unwrap();
        }
        let e = c.bind(&a, "p3").unwrap_err();
        assert!(e.contains("proxy token edge-a has 3 live instances"), "{e}");
        // Known instances go on; other credentials are not affected.
        assert!(c.bind(&a, "p1").is_ok());
        assert!(c.bind(&Caller::Proxy("edge-b".into()), "p9").is_ok());
    }

    #[test]
    fn the_shared_token_and_each_proxy_token_are_a_credential_each() {
        assert_eq!(two_proxies(8).count(), 3);
        assert_eq!(Credentials::open(TERM).count(), 1);
    }

    #[test]
    fn proxy_tokens_are_checked_when_read() {
        assert!(ProxyToken::parse("edge-a").is_err());
        assert!(ProxyToken::parse("edge a=aaaaaaaaaaaaaaaaaaaa").is_err());
        let short = ProxyToken::parse("edge-a=short").err().unwrap();
        assert!(short.contains("at least 16 bytes") && !short.contains("short="));
        assert!(ProxyToken::parse("edge-a=0123456789abcdef").is_ok());
    }
}

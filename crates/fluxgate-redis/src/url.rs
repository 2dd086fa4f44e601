//! Redis URLs: a standalone, cluster or Sentinel configuration from one, and the URL as
//! shown in errors, without its password.

use fred::types::config::Config;

/// A standalone, cluster or Sentinel configuration from a URL. Several comma-separated
/// nodes name a cluster (`redis://host1:6379,host2:6379`), as does a `redis-cluster://`
/// URL; `redis-sentinel://s1:26379?node=s2:26379&sentinelServiceName=mymaster` names the
/// sentinels of a primary.
///
/// A `rediss` scheme is refused unless fred was built with a TLS client (one of its
/// `enable-*tls*` features): without one, fred connects to such a URL in plain text, the
/// password included.
pub(crate) fn parse_url(url: &str) -> Result<Config, String> {
    let config = parse_any_url(url)?;
    if url.starts_with("rediss") && !config.uses_tls() {
        return Err(NO_TLS.to_owned());
    }
    Ok(config)
}

/// Why a `rediss` URL is refused when fred has no TLS client.
const NO_TLS: &str = "TLS was asked for (rediss), but fred was built without a TLS client, so the \
                      connection and its password would go in plain text; enable a TLS feature of fred \
                      (`enable-rustls`, `enable-rustls-ring` or `enable-native-tls`) in the application's \
                      dependencies, or reach Redis through a TLS tunnel with a redis:// URL";

fn parse_any_url(url: &str) -> Result<Config, String> {
    let (scheme, rest) = url
        .split_once("://")
        .filter(|(scheme, _)| {
            matches!(
                *scheme,
                "redis" | "rediss" | "redis-cluster" | "rediss-cluster" | "redis-sentinel" | "rediss-sentinel"
            )
        })
        .ok_or_else(|| "expected a URL starting with redis://, rediss:// or redis-sentinel://".to_owned())?;
    if scheme.ends_with("-sentinel") {
        if !rest.contains("sentinelServiceName=") {
            return Err("a Sentinel URL needs ?sentinelServiceName=<primary name>".to_owned());
        }
        return Config::from_url_sentinel(url).map_err(|e| e.details().to_string());
    }
    let nodes: Vec<&str> = rest.split(',').map(str::trim).collect();
    if nodes.iter().any(|n| n.is_empty()) {
        return Err("a node is empty; list the nodes as host:port,host:port".to_owned());
    }
    if nodes.len() == 1 && !scheme.ends_with("-cluster") {
        return Config::from_url(url).map_err(|e| e.details().to_string());
    }
    let tls = if scheme.starts_with("rediss") {
        "rediss"
    } else {
        "redis"
    };
    let (first, query) = nodes[0].split_once('?').unwrap_or((nodes[0], ""));
    // A cluster has no databases: a `/db` path is dropped.
    let first = first.split('/').next().unwrap_or(first);
    let params: Vec<String> = std::iter::once(query.to_owned())
        .filter(|q| !q.is_empty())
        .chain(
            nodes[1..]
                .iter()
                .map(|n| format!("node={}", n.split('/').next().unwrap_or(n))),
        )
        .collect();
    let mut cluster_url = format!("{tls}-cluster://{first}");
    if !params.is_empty() {
        cluster_url.push('?');
        cluster_url.push_str(&params.join("&"));
    }
    Config::from_url_clustered(&cluster_url).map_err(|e| e.details().to_string())
}

/// The URL without its passwords: the user's (`user:***@`), and the value of any query
/// parameter whose name ends with `password` (a Sentinel URL's `sentinelPassword=***`).
/// How the crate's errors and `Debug` show a Redis URL; for an application's own logs of
/// one too.
///
/// ```
/// assert_eq!(
///     fluxgate_redis::redact_url("redis://app:secret@10.0.0.5:6379/0"),
///     "redis://app:***@10.0.0.5:6379/0"
/// );
/// ```
pub fn redact_url(url: &str) -> String {
    redact(url)
}

pub(crate) fn redact(url: &str) -> String {
    let shown = match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            match userinfo.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..scheme + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    };
    let Some((base, query)) = shown.split_once('?') else {
        return shown;
    };
    let query: Vec<String> = query
        .split('&')
        .map(|param| match param.split_once('=') {
            Some((name, _)) if name.to_ascii_lowercase().ends_with("password") => format!("{name}=***"),
            _ => param.to_owned(),
        })
        .collect();
    format!("{base}?{}", query.join("&"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_not_shown() {
        assert_eq!(
            redact("redis://user:secret@host:6379/0"),
            "redis://user:***@host:6379/0"
        );
        assert_eq!(redact("redis://host:6379"), "redis://host:6379");
    }

    /// A Sentinel URL may hold the sentinels' password in its query
    /// (`sentinelPassword=`, as fred reads it): an error quoting the URL hides it too.
    #[test]
    fn sentinel_passwords_are_not_shown() {
        let url = "redis-sentinel://:node-pw@127.0.0.1:26379?node=127.0.0.1:26380&sentinelPassword=sentinel-pw&x=1";
        assert_eq!(
            redact(url),
            "redis-sentinel://:***@127.0.0.1:26379?node=127.0.0.1:26380&sentinelPassword=***&x=1"
        );
        // Refused (no service name), the error quotes the URL without either password.
        let error = crate::connection::builder(
            url,
            std::time::Duration::from_millis(100),
            std::time::Duration::from_secs(1),
        )
        .map(|_| ())
        .unwrap_err()
        .to_string();
        assert!(!error.contains("node-pw") && !error.contains("sentinel-pw"), "{error}");
    }

    #[test]
    fn urls() {
        use fred::types::config::ServerConfig;
        let standalone = parse_url("redis://user:pw@127.0.0.1:6380/2").unwrap();
        assert!(matches!(standalone.server, ServerConfig::Centralized { .. }));
        assert_eq!(standalone.database, Some(2));
        let cluster = parse_url("redis://:pw@10.0.0.1:7000,10.0.0.2:7001,10.0.0.3:7002").unwrap();
        match cluster.server {
            ServerConfig::Clustered { hosts, .. } => assert_eq!(hosts.len(), 3),
            other => panic!("{other:?}"),
        }
        assert_eq!(cluster.password.as_deref(), Some("pw"));
        let sentinel =
            parse_url("redis-sentinel://127.0.0.1:26379?node=127.0.0.1:26380&sentinelServiceName=mymaster").unwrap();
        assert!(matches!(sentinel.server, ServerConfig::Sentinel { .. }));
        for bad in [
            "http://x",
            "redis://a,,b",
            "127.0.0.1:6379",
            "redis://host:notaport",
            "redis-sentinel://127.0.0.1:26379",
            // No TLS client in fred: refused rather than connected in plain text.
            "rediss://:pw@127.0.0.1:6379",
            "rediss://127.0.0.1:7000,127.0.0.1:7001",
            "rediss-cluster://127.0.0.1:7000",
            "rediss-sentinel://127.0.0.1:26379?sentinelServiceName=mymaster",
        ] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
    }
}

//! The OpenAPI document of the service, generated from the types and handlers themselves
//! (so it cannot drift), served at `GET /openapi.json` and kept in the repository as
//! `crates/fluxgate-server/openapi.json` (a test checks the two agree).

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use crate::app;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "FluxGate rate-limit service",
        description = "The FluxGate engine over HTTP: decide requests, administer rule sets, health and metrics."
    ),
    paths(
        app::check,
        app::check_batch,
        app::list_rule_sets,
        app::get_rule_set,
        app::put_rule_set,
        app::delete_rule_set,
        app::health,
        app::metrics,
        app::openapi_document,
    ),
    modifiers(&BearerToken),
    tags(
        (name = "check", description = "Rate-limit decisions"),
        (name = "rules", description = "Rule set administration (bearer token)"),
        (name = "operations", description = "Health, metrics and this document"),
    )
)]
struct ApiDoc;

/// The admin endpoints' bearer token.
struct BearerToken;

impl Modify for BearerToken {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The document.
pub fn document() -> utoipa::openapi::OpenApi {
    let mut document = ApiDoc::openapi();
    document.info.version = env!("CARGO_PKG_VERSION").to_owned();
    document
}

/// The document as pretty-printed JSON, ending with a newline.
pub fn json() -> String {
    let mut text = document()
        .to_pretty_json()
        .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
    text.push('\n');
    text
}

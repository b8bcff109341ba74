//! What the runtime adds to a kube client.

use kube::Client;

/// `client` with `name=value` added to the query of every request it sends: for a request
/// parameter kube's typed parameters do not have (the alpha `shardSelector`). The requests
/// still go through `client`'s layers (rate limit, metrics).
pub fn with_query(client: Client, name: &str, value: &str) -> Client {
    let default_namespace = client.default_namespace().to_string();
    let pair: String = form_urlencoded::Serializer::new(String::new()).append_pair(name, value).finish();
    let service = tower::service_fn(move |mut request: http::Request<kube::client::Body>| {
        let client = client.clone();
        let uri = request.uri();
        let query = match uri.query() {
            Some(query) => format!("{query}&{pair}"),
            None => pair.clone(),
        };
        let with_query = format!("{}?{query}", uri.path()).parse::<http::uri::PathAndQuery>();
        async move {
            let mut parts = request.uri().clone().into_parts();
            parts.path_and_query = Some(with_query.map_err(|e| kube::Error::Service(e.into()))?);
            *request.uri_mut() = http::Uri::from_parts(parts).map_err(|e| kube::Error::Service(e.into()))?;
            client.send(request).await
        }
    });
    Client::new(service, default_namespace)
}

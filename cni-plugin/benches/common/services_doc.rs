//! What the Service-layer benches share: the 10,000-Service document the agent sends (and
//! the same Services as the layer's model), the change documents of the churn, and their
//! medians.

use std::net::Ipv4Addr;
use std::time::Duration;

use aether_rules::model::Proto;
use aether_rules::services::{LayerMode, ServiceLayer, ServicePort};
use serde_json::{json, Value};

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Service `i`: a VIP in 10.96.0.0/15 and two TCP ports; one in ten has no endpoint.
pub fn service_vip(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(0x0a60_0000 + 2 + i)
}

pub fn service_ports(i: u32) -> [u16; 2] {
    [80, 8080 + (i % 7) as u16]
}

pub fn snapshot(generation: u64, n: u32) -> Vec<u8> {
    let services: Vec<Value> = (0..n)
        .map(|i| {
            let ports: Vec<Value> = service_ports(i).iter().map(|p| json!({"protocol": "TCP", "port": p})).collect();
            json!({"namespace": format!("ns-{}", i % 50), "name": format!("svc-{i}"), "vip": service_vip(i).to_string(),
                   "ports": ports, "usableEndpoints": i % 10 != 0})
        })
        .collect();
    serde_json::to_vec(&json!({"generation": generation, "mode": "refuse", "serviceRanges": ["10.96.0.0/15"],
        "meshVIPs": [], "services": services}))
    .unwrap()
}

/// The same Services as `snapshot`, as the layer's model.
pub fn layer(n: u32) -> ServiceLayer {
    let mut l = ServiceLayer::new(LayerMode::Refuse);
    l.ranges = vec!["10.96.0.0/15".parse().unwrap()];
    l.ports = (0..n)
        .flat_map(|i| {
            service_ports(i).map(|port| ServicePort {
                vip: service_vip(i).into(),
                proto: Proto::Tcp,
                port,
                has_endpoints: i % 10 != 0,
            })
        })
        .collect();
    l
}

/// A Service the change rows add, flip and remove (`churn/c-k`, in the ranges' second /16).
pub fn churn_service(k: u32, usable: bool) -> Value {
    json!({"namespace": "churn", "name": format!("c-{k}"), "vip": Ipv4Addr::from(0x0a61_8000 + k).to_string(),
           "ports": [{"protocol": "TCP", "port": 443}], "usableEndpoints": usable})
}

/// The three changes of round `k` (a Service added, its endpoints flipped to none, removed),
/// each with the result every pod must report.
pub fn churn_docs(k: u32) -> [(Value, &'static str); 3] {
    [
        (json!({"servicesPut": [churn_service(k, true)]}), "elements +2 -0"),
        (
            json!({"endpoints": [{"namespace": "churn", "name": format!("c-{k}"), "usableEndpoints": false}]}),
            "elements +1 -1",
        ),
        (json!({"servicesRemoved": [{"namespace": "churn", "name": format!("c-{k}")}]}), "elements +0 -2"),
    ]
}

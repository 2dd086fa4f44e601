//! The shared decision scenarios, run against the in-memory backend on a paused clock.

use crate::support::{scenarios, Memory};

#[tokio::test(start_paused = true)]
async fn hundred_per_minute_through_the_engine() {
    scenarios::hundred_per_minute_engine(&Memory).await;
}

#[tokio::test(start_paused = true)]
async fn hundred_per_minute_through_the_layer() {
    scenarios::hundred_per_minute_layer(&Memory).await;
}

#[tokio::test(start_paused = true)]
async fn two_bands_reject_the_eleventh() {
    scenarios::two_bands(&Memory).await;
}

#[tokio::test(start_paused = true)]
async fn permits_three_five_three() {
    scenarios::permits(&Memory).await;
}

#[tokio::test(start_paused = true)]
async fn per_ip_and_global_rejection_consumes_nothing() {
    scenarios::per_ip_and_global(&Memory).await;
}

#[tokio::test(start_paused = true)]
async fn remaining_is_the_least_over_all_bands() {
    scenarios::remaining_is_the_least(&Memory).await;
}

#[tokio::test(start_paused = true)]
async fn keys_are_isolated() {
    scenarios::isolation(&Memory).await;
}

#[tokio::test(start_paused = true)]
async fn ipv6_clients() {
    scenarios::ipv6(&Memory).await;
}

#[tokio::test(start_paused = true)]
async fn exact_refill() {
    scenarios::exact_refill(&Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrency_is_exact() {
    scenarios::concurrency(&Memory).await;
}

#[tokio::test(start_paused = true)]
async fn hostile_header_values() {
    scenarios::hostile_header_values(&Memory).await;
}

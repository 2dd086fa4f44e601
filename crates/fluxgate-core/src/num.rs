//! Integer helpers shared by the algorithms and the response headers.

use std::time::Duration;

/// `a / b`, with the hardware's 64-bit division whenever both fit (nearly always).
#[inline]
pub(crate) fn div(a: u128, b: u128) -> u128 {
    match (u64::try_from(a), u64::try_from(b)) {
        (Ok(a), Ok(b)) => u128::from(a / b),
        _ => a / b,
    }
}

/// `a / b`, rounded up.
#[inline]
pub(crate) fn ceil_div(a: u128, b: u128) -> u128 {
    let q = div(a, b);
    if q * b < a {
        q + 1
    } else {
        q
    }
}

/// `v`, or `u64::MAX` when it does not fit.
#[inline]
pub(crate) fn to_u64(v: u128) -> u64 {
    u64::try_from(v).unwrap_or(u64::MAX)
}

/// Whole seconds, rounded up.
///
/// ```
/// use std::time::Duration;
/// assert_eq!(fluxgate_core::num::ceil_secs(Duration::from_millis(1001)), 2);
/// assert_eq!(fluxgate_core::num::ceil_secs(Duration::from_secs(3)), 3);
/// ```
pub fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

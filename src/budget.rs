//! A budget on request-body bytes buffered at once, one per caller class: on the gRPC port one for
//! ext_proc (its messages and the bodies its streams hold) and one for Pick messages, so neither
//! can spend the other's; on the admin port one for explain inputs. Past it a stream's
//! next chunk is refused with a fast 503 instead of growing memory (1,500 streams each holding
//! 1 MiB once took RSS to 3 GB).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Shared by every stream of one service.
#[derive(Debug, Clone)]
pub struct BodyBudget {
    used: Arc<AtomicUsize>,
    limit: usize,
}

impl BodyBudget {
    /// At most `limit` bytes buffered at once.
    pub fn new(limit: usize) -> Self {
        Self {
            used: Arc::new(AtomicUsize::new(0)),
            limit,
        }
    }

    /// Bytes buffered now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// An empty reservation against this budget.
    pub fn reservation(&self) -> Reservation {
        Reservation {
            budget: self.clone(),
            held: 0,
        }
    }
}

/// Bytes one stream holds; returned when released or dropped.
#[derive(Debug)]
pub struct Reservation {
    budget: BodyBudget,
    held: usize,
}

impl Reservation {
    /// Takes `n` more bytes, or nothing when the budget would be exceeded.
    pub fn grow(&mut self, n: usize) -> bool {
        let b = &self.budget;
        let ok = b
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                u.checked_add(n).filter(|&t| t <= b.limit)
            })
            .is_ok();
        if ok {
            self.held += n;
        }
        ok
    }

    /// Bytes held now.
    pub fn held(&self) -> usize {
        self.held
    }

    /// Returns everything held.
    pub fn release(&mut self) {
        self.budget.used.fetch_sub(self.held, Ordering::AcqRel);
        self.held = 0;
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.release();
    }
}

/// Why a metered gRPC request body was refused before its bytes were buffered. It travels in the
/// body's error status (metadata [`Refused::KEY`]) so the service reading the body answers its
/// own way: ext_proc replies 413 or 503 to Envoy's client instead of ending the stream blank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// A message announced more than the service's message limit.
    TooLarge,
    /// The budget was spent.
    Spent,
    /// A message started and was not complete in time.
    Stalled,
}

impl Refused {
    /// The metadata key of the refusal's status.
    pub const KEY: &'static str = "x-kv-router-refused";

    fn as_str(self) -> &'static str {
        match self {
            Refused::TooLarge => "too-large",
            Refused::Spent => "budget",
            Refused::Stalled => "stalled",
        }
    }

    /// The body's error: RESOURCE_EXHAUSTED, or DEADLINE_EXCEEDED when stalled.
    pub fn status(self, message: String) -> tonic::Status {
        let mut status = match self {
            Refused::TooLarge | Refused::Spent => tonic::Status::resource_exhausted(message),
            Refused::Stalled => tonic::Status::deadline_exceeded(message),
        };
        status.metadata_mut().insert(
            Self::KEY,
            tonic::metadata::MetadataValue::from_static(self.as_str()),
        );
        status
    }

    /// The refusal `status` carries, if it is one.
    pub fn of(status: &tonic::Status) -> Option<Self> {
        let v = status.metadata().get(Self::KEY)?.to_str().ok()?;
        [Refused::TooLarge, Refused::Spent, Refused::Stalled]
            .into_iter()
            .find(|r| r.as_str() == v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_share_one_limit_and_give_back_on_drop() {
        let budget = BodyBudget::new(100);
        let mut a = budget.reservation();
        let mut b = budget.reservation();
        assert!(a.grow(60));
        assert!(!b.grow(41), "over the shared limit");
        assert!(b.grow(40));
        assert_eq!(budget.used(), 100);
        drop(a);
        assert_eq!(budget.used(), 40);
        b.release();
        assert_eq!(budget.used(), 0);
        assert!(!budget.reservation().grow(usize::MAX), "no overflow");
    }
}

package acmetest_test

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/ngstone/ngstone/internal/acmetest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m, acmetest.CertmagicLeaks...) }

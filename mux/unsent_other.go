//go:build !linux && !darwin

package mux

import "errors"

func setNotSentLowat(uintptr, int) {}

func getNotSentLowat(uintptr) (int, error) { return 0, errors.ErrUnsupported }

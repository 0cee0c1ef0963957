"""What the tests share and are not tests themselves: fakes, helper modules, programs the tests run."""

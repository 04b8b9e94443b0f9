# The aci backend's configuration (AciConfig::new(subscription_id, resource_group, location, subnet_id)).
output "subscription_id" {
  value = data.azurerm_subscription.current.subscription_id
}

output "resource_group" {
  value = azurerm_resource_group.physalia.name
}

output "location" {
  value = azurerm_resource_group.physalia.location
}

output "subnet_id" {
  value = azurerm_subnet.workers.id
}

output "coordinator_identity_id" {
  description = "AciConfig.coordinator_identity_id: the user-assigned identity cluster mode's coordinator group runs as."
  value       = azurerm_user_assigned_identity.coordinator.id
}

output "coordinator_identity_client_id" {
  description = "AZURE_CLIENT_ID for azure_identity's ManagedIdentityCredential in the coordinator."
  value       = azurerm_user_assigned_identity.coordinator.client_id
}

output "pull_identity_id" {
  description = "AciConfig.registry.identity_id (null without a registry)."
  value       = var.registry_id == null ? null : azurerm_user_assigned_identity.pull[0].id
}

output "coordinator_ip" {
  description = "The coordinator's private IP (null when no coordinator was created)."
  value       = var.coordinator_image == null ? null : azurerm_container_group.coordinator[0].ip_address
}
